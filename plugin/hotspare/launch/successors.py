"""The successor policy: when a spare of this node is promoted to a rank, a new spare (its
successor) is registered with the coordinator at once, and started once its generation (or a
later one) is back at the step the failure interrupted, another failure was reported, or
``--successor-wait-s`` ran out: a starting spare's imports and build compete for the node's
cores with the recovery and the catch-up."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .processes import log


@dataclass
class Successor:
    """A spare registered to follow one promoted in ``generation``, not started yet."""

    wid: str
    node: int
    generation: int
    failures_read: int
    """The plan's ``failures_read``: a failure beyond it needs this spare now."""
    deadline: float


class Successors:
    """This node's registered successors, not started yet."""

    def __init__(self, wait_s: float, control: Callable, spawn: Callable[[str, int], object]):
        self.wait_s, self._control, self._spawn = wait_s, control, spawn
        self.pending: list[Successor] = []

    def register(self, wid: str, node: int, plan) -> str:
        """``wid`` (registered already) follows a spare promoted by ``plan``."""
        self.pending.append(Successor(wid, node, plan.generation, plan.failures_read, time.monotonic() + self.wait_s))
        return wid

    def start_due(self, generation: int) -> None:
        """Start the successors whose time has come (``generation``: the newest this launcher follows)."""
        if not self.pending:
            return
        control = self._control()
        now = time.monotonic()
        failures = control.failure_count()
        for s in list(self.pending):
            caught_up = any(control.caught_up(g) for g in range(s.generation, generation + 1))
            why = ("the generation caught up" if caught_up else "another failure came" if failures > s.failures_read
                   else f"--successor-wait-s={self.wait_s} ran out" if now >= s.deadline else "")
            if why:
                self.pending.remove(s)
                self._spawn(s.wid, s.node)
                log(f"starting spare {s.wid} on node {s.node} ({why})")
