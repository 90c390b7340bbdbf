"""The alarm guard: the coordinator's word that a worker's generation failed, against the
training thread's own leaving of it.

The coordinator alarms every worker of a generation the moment it learns that the generation
failed (``alarm/<g>/<wid>``, :class:`hotspare.worker.Heartbeat` waits on it in a thread): a peer
is dying (its sockets reset only once the kernel tore down its memory) or was given up without a
broken socket (a lost or partitioned node). The worker then leaves at once, instead of at its
collectives' timeout: :meth:`AlarmGuard.superseded` runs the session's leaving (breaking its
connections), and a forward under way raises :class:`GenerationFailed`
(:meth:`AlarmGuard.raise_if_alarmed`, a forward pre-hook).

The alarm thread may pass its check and run only after the training thread saw the failure on
its own and began its recovery; run then, it would mark the next generation failed (its first
forward raised: a spurious second recovery, seen on DeepSpeed) or break the next generation's
new connections. Under one lock, an alarm for a generation the training thread began to leave
(:meth:`AlarmGuard.begin_leaving`) is dropped.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from .recovery import GenerationFailed


class AlarmGuard:
    """``leave(generation)`` runs (from the alarm thread) for an alarm the training thread has not
    answered yet, once per generation."""

    def __init__(self, leave: Callable[[int], None]):
        self._leave = leave
        self._lock = threading.Lock()
        self.alarmed = -1
        """The generation the coordinator's alarm said failed (while this worker trained in it)."""
        self.leaving = -1
        """The newest generation the training thread began to leave."""

    def superseded(self, generation: int) -> bool:
        """The coordinator said that ``generation`` failed; returns whether this worker leaves now
        (False: the training thread began to leave it already)."""
        with self._lock:
            if generation <= self.leaving:
                return False
            self.alarmed = generation
            self._leave(generation)
            return True

    def begin_leaving(self, generation: int) -> None:
        """The training thread leaves ``generation``: an alarm for it from now on is answered."""
        with self._lock:
            self.leaving = max(self.leaving, generation)

    def raise_if_alarmed(self, generation: int) -> None:
        """In the training thread: raise GenerationFailed if ``generation`` was said to have failed."""
        if self.alarmed == generation:
            raise GenerationFailed(f"the coordinator says generation {generation} failed (a peer died or left); "
                                   f"leaving the step for the recovery")
