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

import psutil


def break_connections(keep_ports: set[int]) -> int:
    """Shut down this process's established TCP connections, except to ``keep_ports``; returns how many."""
    count = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr or conn.fd < 0:
            continue
        if conn.raddr.port in keep_ports or conn.laddr.port in keep_ports:
            continue
        try:
            dup = socket.socket(fileno=os.dup(conn.fd))
        except OSError:
            continue  # closed meanwhile
        try:
            dup.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            dup.close()  # closes the duplicate only; the shutdown applies to the shared socket
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
