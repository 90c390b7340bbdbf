"""Addresses: the store's listening socket, the address a node advertises and its interface."""
from __future__ import annotations

import socket


def listen_socket(addr: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``addr`` only (port 0: a free one)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on --master-addr {addr} port {port}: {exc} (is the address this "
                         f"machine's, and the port free?)") from None
    sock.listen(1024)
    sock.set_inheritable(False)
    return sock


def route_to(addr: str) -> str:
    """The local address this machine reaches ``addr`` from (a UDP connect: nothing is sent)."""
    family = socket.getaddrinfo(addr, 1, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 1))
            return s.getsockname()[0]
        except OSError:
            return addr


def interface_of(addr: str) -> str:
    """The name of the local interface that holds ``addr`` ('' when none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    return ""
