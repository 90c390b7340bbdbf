"""Fault points: named places inside hotspare where a test or a benchmark can inject a fault.

Production code calls :func:`hit` at each point (a dict lookup when nothing is armed); a
test arms a point in the process that should fail::

    faults.arm("keeper_commit", at=1, action="kill")   # SIGKILL before chunk 1's commit record

Points: ``snapshot_write`` (index: segments of the snapshot written so far in a capture),
``keeper_commit`` (index: chunks of a retained update committed so far), ``join`` (index: the
generation being joined: a fault while a recovery forms). Actions: ``kill``
(SIGKILL, like an OOM kill or a crash), ``segv`` (SIGSEGV), ``hang`` (SIGSTOP), ``raise``
(RuntimeError), ``node`` (:func:`lose_node`). ``at=ANY`` fires at the first index reached.
The catalogue the fault matrix draws from is :mod:`hotspare.testing.faults`.

:func:`lose_node` stands for the loss of a whole (logical) node under ``hotspare-run
--logical-nodes``: it SIGKILLs every process of this worker's node, keeper and spares
included, then this one.
"""
from __future__ import annotations

import os
import signal

ACTIONS = ("kill", "segv", "hang", "raise", "node")
ANY = -1
"""``arm(point, at=ANY)``: fire at the first index the point is reached with."""
_armed: dict[str, tuple] = {}


def arm(point: str, at: int, action="kill") -> None:
    """Fire ``action`` when ``point`` is reached with index ``at`` (once); ``action`` is one of
    :data:`ACTIONS` or a callable (called with no argument, as the fault)."""
    if not callable(action) and action not in ACTIONS:
        raise ValueError(f"fault action {action!r}: expected one of {', '.join(ACTIONS)}")
    _armed[point] = (at, action)


def disarm() -> None:
    _armed.clear()


def hit(point: str, index: int = 0) -> None:
    """A fault point; fires the armed action when ``point`` is armed at ``index``."""
    if not _armed:
        return
    armed = _armed.get(point)
    if armed is None or armed[0] not in (index, ANY):
        return
    del _armed[point]
    action = armed[1]
    if callable(action):
        action()
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "node":
        lose_node()
    else:
        raise RuntimeError(f"injected fault at {point}[{index}]")


def lose_node() -> None:
    """SIGKILL this worker's (logical) node: its keeper, its spares and its other active ranks
    (siblings under the same launcher), then this process."""
    import psutil

    from . import env

    node = os.environ.get(env.HOTSPARE_NODE_RANK, "0")
    for p in psutil.Process(os.getppid()).children():
        if p.pid == os.getpid():
            continue
        try:
            cmd, environ = p.cmdline(), p.environ()
        except psutil.Error:
            continue
        is_keeper = "hotspare.keeper" in cmd and "--node" in cmd and cmd[cmd.index("--node") + 1] == node
        is_worker = environ.get(env.HOTSPARE_ROLE) in ("spare", "active") and environ.get(env.HOTSPARE_NODE_RANK) == node
        if is_keeper or is_worker:
            p.kill()
    os.kill(os.getpid(), signal.SIGKILL)
