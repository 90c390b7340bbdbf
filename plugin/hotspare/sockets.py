"""Breaking a failed generation's connections, so that every survivor learns of the failure.

When a rank dies, only the collectives that were waiting on *it* fail. A survivor blocked in a
collective with live peers (say, waiting for a rank that already left that collective with an
error) would wait for the full collective timeout. gloo has no working abort for that: on
torch 2.13 ``ProcessGroupGloo.abort()`` and ``shutdown()`` return without closing the pairs,
and the groups' sockets stay open as long as DeepSpeed holds a reference to the group.

So a survivor that sees a failure shuts down (``shutdown(2)``) every established TCP
connection of its process except those to the control store: its peers read EOF at once and
fail in turn, and within a few milliseconds every survivor is out of the old generation.
NCCL communicators are aborted through torch's own call instead.

It shuts each connection in two stages, reading side first. gloo (torch 2.13) writes a send at
once when the peer's receive is already posted; if that write meets a connection whose writing
side is shut, it fails with EPIPE and gloo queues the send without an error, and the end of file
that follows does not wake it: the send waits out the group's timeout while its peer, told by
the end of file, left long ago (issue 32: a tensor-parallel survivor blocked in an all_reduce).
With the reading side shut first, gloo reads end of file, marks the pair failed and closes its
descriptor while writes still work, so every later send on it fails at once; only then is the
writing side shut, which tells the peer (tests/test_recovery_pieces.py pins both orders).

A payload already on the wire is not cut: gloo (torch 2.13) does not wake a send or receive
whose bytes were moving when its connection was shut down; both ends wait out the group's
timeout (tests/test_recovery_pieces.py pins it), while an operation that is posted but not yet
moving fails at once. A connection still moving data is shut down once it is quiet
(:func:`break_connections`).
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import termios
import time
from typing import NamedTuple

FD_DIR = "/proc/self/fd"


QUIET_MS = 10
"""A connection with nothing queued either way and no data received for this long carries no
payload. A payload moves without pause unless its sender is descheduled (a few ms on a loaded
host); the kernel's clock for it ticks in 1-10 ms."""
STALL_MS = 50
"""A connection with bytes queued and nothing received (data or acknowledgement) for this long
is not moving: its peer is gone without a reset (a lost node) or stopped reading."""
DRAIN_S = 0.1
"""The longest a connection still moving data is given before it is shut down anyway."""
POLL_S = 0.001

_TCP_INFO_LEN = 104
_TCP_ESTABLISHED = 1  # tcpi_state, struct tcp_info's first byte
_LAST_DATA_RECV, _LAST_ACK_RECV = 52, 56  # byte offsets in Linux's struct tcp_info (u32, ms)


def _connections(keep_ports: set[int]) -> list[socket.socket]:
    """Duplicates of this process's connected TCP sockets, except to or from ``keep_ports``
    (the caller closes them; shutting one down applies to the socket it shares with gloo).

    Reads only this process's descriptors (not the machine's whole connection table, which
    psutil scans: 20-30 ms on a busy host, on the path from a failure to the new plan)."""
    try:
        fds = os.listdir(FD_DIR)
    except OSError:
        return []
    out = []
    for name in fds:
        try:
            if not os.readlink(f"{FD_DIR}/{name}").startswith("socket:"):
                continue
            fd = os.dup(int(name))
        except OSError:
            continue  # closed meanwhile, or not ours to look at
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)  # its number went to something else meanwhile
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                remote = sock.getpeername()[1]
                if sock.getsockname()[1] not in keep_ports and remote not in keep_ports:
                    out.append(sock)
                    continue
        except OSError:
            pass  # a listener, or not connected
        sock.close()
    return out


def _queued(sock: socket.socket, request: int) -> int:
    buf = bytearray(4)
    fcntl.ioctl(sock.fileno(), request, buf)
    return struct.unpack("i", buf)[0]


def moving(sock: socket.socket) -> bool:
    """Whether ``sock`` is carrying a payload now: bytes queued to send or to read, or data
    received in the last :data:`QUIET_MS`, unless nothing at all came in for :data:`STALL_MS` or
    the connection is no longer established (its peer closed or reset it: nothing more comes)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        last_data, last_ack = struct.unpack_from("II", info, _LAST_DATA_RECV)
        queued = _queued(sock, termios.TIOCOUTQ) + _queued(sock, termios.FIONREAD)
    except (OSError, struct.error):
        return False
    if info[0] != _TCP_ESTABLISHED or min(last_data, last_ack) >= STALL_MS:
        return False
    return queued > 0 or last_data < QUIET_MS


CLOSE_WAIT_S = 0.05
"""How long a connection's owner is given to close its descriptor after the reading side was
shut (gloo's loop takes 1-2 ms here) before the writing side is shut anyway."""


class Broken(NamedTuple):
    """What :func:`break_connections` did."""

    count: int
    """Connections shut down."""
    forced: int
    """Of those, the ones still carrying a payload when ``drain_s`` ran out: a collective moving
    it waits out its group's timeout on both ends (gloo does not wake it)."""


def _held(inodes: set[int], mine: set[int]) -> set[int]:
    """Of the sockets ``inodes``, those some descriptor of this process other than ``mine``
    (the duplicates) still refers to."""
    held = set()
    try:
        names = os.listdir(FD_DIR)
    except OSError:
        return held
    for name in names:
        if int(name) in mine:
            continue
        try:
            inode = os.stat(f"{FD_DIR}/{name}").st_ino
        except OSError:
            continue
        if inode in inodes:
            held.add(inode)
    return held


def break_connections(keep_ports: set[int], drain_s: float = DRAIN_S) -> Broken:
    """Shut down this process's connected TCP sockets, except to or from ``keep_ports``. A
    connection carrying a payload (:func:`moving`) is shut down once it is quiet, or after
    ``drain_s`` (counted as forced): cutting it would leave both ends waiting out their timeout
    (see the module's docstring). The others are shut down at once.

    Each in two stages (the module's docstring says why): the reading side, then the writing
    side once the owner closed its descriptor, or after :data:`CLOSE_WAIT_S`."""
    socks = _connections(keep_ports)
    mine = {sock.fileno() for sock in socks}
    count = forced = 0
    deadline = time.monotonic() + drain_s
    reading_shut: dict[socket.socket, tuple[int, float]] = {}  # sock -> (inode, when)
    try:
        pending = socks
        while pending or reading_shut:
            now = time.monotonic()
            last = now >= deadline
            busy = []
            for sock in pending:
                still = moving(sock)
                if still and not last:
                    busy.append(sock)
                    continue
                try:
                    inode = os.fstat(sock.fileno()).st_ino
                    sock.shutdown(socket.SHUT_RD)
                except OSError:
                    continue
                reading_shut[sock] = (inode, now)
                count += 1
                forced += still
            pending = busy
            if reading_shut:
                held = _held({inode for inode, _ in reading_shut.values()}, mine)
                now = time.monotonic()
                for sock, (inode, when) in list(reading_shut.items()):
                    late = now - when >= CLOSE_WAIT_S
                    if inode in held and not late:
                        continue
                    try:
                        sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass  # the peer reset it meanwhile: it knows
                    del reading_shut[sock]
            if pending or reading_shut:
                time.sleep(POLL_S)
    finally:
        for sock in socks:
            sock.close()  # the duplicate only
    return Broken(count, forced)


def abort_nccl(groups) -> None:
    """Abort the NCCL communicators of ``groups`` (blocked kernels return); gloo groups are skipped.

    Each group's own ``abort()``, all inside one ``ncclGroupStart/End`` (aborting several
    communicators one by one can deadlock them: pytorch#119797; torch brackets its own abort of
    WORLD the same way). Not ``distributed_c10d._abort_process_group``: for a group other than
    WORLD it also unregisters the group, so the rebuild's walk could no longer ask its ranks
    (``get_process_group_ranks`` raises KeyError) and the recovery would die; the aborted groups
    stay registered until the generation is left (``generation.leave`` destroys them)."""
    import torch
    import torch.distributed as dist

    nccl = []
    for group in groups:
        try:
            if group is not None and group not in nccl and str(dist.get_backend(group)) == "nccl":
                nccl.append(group)
        except (RuntimeError, ValueError, AttributeError):
            pass
    if not nccl:
        return
    try:
        first = nccl[0]._get_backend(torch.device("cuda"))
        bracket = hasattr(first, "_group_start")
    except (RuntimeError, AttributeError):
        first, bracket = None, False
    try:
        if bracket:
            first._group_start()
        for group in nccl:
            try:
                group.abort()
            except RuntimeError:
                pass
    finally:
        if bracket:
            try:
                first._group_end()
            except RuntimeError:
                pass
