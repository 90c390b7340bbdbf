"""The successor policy: when a spare of this node is promoted to a rank, a new spare (its
successor) is registered with the coordinator at once, and started once its generation (or a
later one) is back at the step the failure interrupted, another failure was reported, or
``--successor-wait-s`` ran out: a starting spare's imports and build compete for the node's
cores with the recovery and the catch-up.

"Another failure" is a failure entry signed by the job and parsed (read with a list cursor of
this policy's own), past the plan's ``failures_read`` and for a worker the plan does not answer:
never a raw counter, which a stranger could move."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..control import ListCursor, keys
from .processes import log


@dataclass
class Successor:
    """A spare registered to follow one promoted in ``generation``, not started yet."""

    wid: str
    node: int
    generation: int
    failures_read: int
    """The plan's ``failures_read``: a failure at or past it that the plan does not answer needs this spare now."""
    deadline: float
    answered: frozenset[str] = frozenset()
    """The workers whose failures the plan answers."""


class Successors:
    """This node's registered successors, not started yet."""

    def __init__(self, wait_s: float, control: Callable, spawn: Callable[[str, int], object],
                 clock: Callable[[], float] = time.monotonic):
        self.wait_s, self.control, self._spawn, self.clock = wait_s, control, spawn, clock
        """``control()``: the launcher's ControlStore; ``clock``: seconds, monotonic (tests drive one)."""
        self.pending: list[Successor] = []
        self._cursor = ListCursor(keys.FAIL)
        self._failures: list[tuple[int, str]] = []  # (index, worker) of every verified failure read

    def register(self, wid: str, node: int, plan) -> str:
        """``wid`` (registered already) follows a spare promoted by ``plan``."""
        answered = frozenset(f["worker"] for f in plan.failures)
        self.pending.append(Successor(wid, node, plan.generation, plan.failures_read, self.clock() + self.wait_s,
                                      answered))
        return wid

    def _another_failure(self, s: Successor) -> bool:
        return any(i >= s.failures_read and worker not in s.answered for i, worker in self._failures)

    def start_due(self, generation: int) -> None:
        """Start the successors whose time has come (``generation``: the newest this launcher follows)."""
        if not self.pending:
            return
        control = self.control()
        now = self.clock()
        self._failures += [(i, f.worker) for i, f in control.read(self._cursor)]
        for s in list(self.pending):
            caught_up = any(control.caught_up(g) for g in range(s.generation, generation + 1))
            why = ("the generation caught up" if caught_up else "another failure came" if self._another_failure(s)
                   else f"--successor-wait-s={self.wait_s} ran out" if now >= s.deadline else "")
            if why:
                self.pending.remove(s)
                self._spawn(s.wid, s.node)
                log(f"starting spare {s.wid} on node {s.node} ({why})")
