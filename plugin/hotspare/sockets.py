"""Breaking a failed generation's connections, so that every survivor learns of the failure.

When a rank dies, only the collectives that were waiting on *it* fail. A survivor blocked in a
collective with live peers (say, waiting for a rank that already left that collective with an
error) would wait for the full collective timeout. gloo has no working abort for that: on
torch 2.13 ``ProcessGroupGloo.abort()`` and ``shutdown()`` return without closing the pairs,
and the groups' sockets stay open as long as DeepSpeed holds a reference to the group.

So a survivor that sees a failure shuts down (``shutdown(2)``, SHUT_RDWR) every established
TCP connection of its process except those to the control store: its peers read EOF at once
and fail in turn, and within a few milliseconds every survivor is out of the old generation.
The file descriptors stay open (gloo owns them; they are closed when the groups are destroyed).
NCCL communicators are aborted through torch's own call instead.
"""
from __future__ import annotations

import os
import socket

FD_DIR = "/proc/self/fd"


def _tcp_peers():
    """(fd, local port, peer port) of each connected TCP socket of this process.

    Reads only this process's descriptors (not the machine's whole connection table, which
    psutil scans: 20-30 ms on a busy host, on the path from a failure to the new plan)."""
    try:
        fds = os.listdir(FD_DIR)
    except OSError:
        return
    for name in fds:
        fd = int(name)
        try:
            if not os.readlink(f"{FD_DIR}/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile, or not ours to look at
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()
            except OSError:
                continue  # a listener, or not connected
            yield sock, sock.getsockname()[1], peer[1]
        finally:
            sock.close()  # closes the duplicate only


def break_connections(keep_ports: set[int]) -> int:
    """Shut down this process's connected TCP sockets, except to or from ``keep_ports``; returns how many."""
    count = 0
    for dup, local, remote in _tcp_peers():
        if local in keep_ports or remote in keep_ports:
            continue
        try:
            dup.shutdown(socket.SHUT_RDWR)  # applies to the shared socket: gloo's descriptor sees it
            count += 1
        except OSError:
            pass
    return count


def abort_nccl(groups) -> None:
    """Abort the NCCL communicators of ``groups`` (blocked kernels return); gloo groups are skipped."""
    import torch.distributed as dist

    for group in groups:
        try:
            if str(dist.get_backend(group)) == "nccl":
                dist.distributed_c10d._abort_process_group(group)
        except (RuntimeError, ValueError, AttributeError):
            pass
