"""Fault points: named places inside hotspare where a test or a benchmark can inject a fault.

Production code calls :func:`hit` at each point (a dict lookup when nothing is armed); a
test arms a point in the process that should fail::

    faults.arm("keeper_commit", at=1, action="kill")   # SIGKILL before chunk 1's commit record

Points: ``snapshot_write`` (index: segments of the snapshot written so far in a capture),
``keeper_commit`` (index: chunks of a retained update committed so far). Actions: ``kill``
(SIGKILL, like an OOM kill or a crash), ``hang`` (SIGSTOP), ``raise`` (RuntimeError).
"""
from __future__ import annotations

import os
import signal

ACTIONS = ("kill", "hang", "raise")
_armed: dict[str, tuple[int, str]] = {}


def arm(point: str, at: int, action: str = "kill") -> None:
    """Fire ``action`` when ``point`` is reached with index ``at`` (once)."""
    if action not in ACTIONS:
        raise ValueError(f"fault action {action!r}: expected one of {', '.join(ACTIONS)}")
    _armed[point] = (at, action)


def disarm() -> None:
    _armed.clear()


def hit(point: str, index: int = 0) -> None:
    """A fault point; fires the armed action when ``point`` is armed at ``index``."""
    if not _armed:
        return
    armed = _armed.get(point)
    if armed is None or armed[0] != index:
        return
    del _armed[point]
    action = armed[1]
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise RuntimeError(f"injected fault at {point}[{index}]")
