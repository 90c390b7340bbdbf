"""A rank's side of stragglers and planned handover (``"stragglers"`` in the config, and the
drain command): its compute time per step goes out with its heartbeat, and when its launcher
says it is to be handed over, it leaves at the next step boundary.

The handover reuses the recovery: the retiring rank waits until the mirror round of the step it
just completed has committed (its holders and its keeper have that version), says so, and exits
with :data:`hotspare.control.HANDED_OVER_EXIT_CODE`. Its launcher reports the exit as a
handover, not a failure; the coordinator gives the rank to a ready spare; the other ranks, in
the next step's first collective, land on the version the retiring rank completed, so no
iteration is lost (the part of a step they had done is computed again).
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from .. import control
from ..events import log
from ..stragglers import ComputeClock


class Handover:
    """A worker's compute clock and its retirement flag (one per session, in the training thread)."""

    def __init__(self, session, modules: list, why_not: str | None):
        self.session = session
        self.requested = threading.Event()
        self.clock = None
        cfg = session.config.stragglers if session.config is not None else None
        if cfg is not None and cfg.enabled and session.heartbeat is not None:
            if why_not is not None:
                if session.generation.rank == 0:
                    log(f"stragglers.enabled: no compute time is measured here: {why_not}; only an operator's "
                        f"handover or drain moves a rank")
            elif modules:
                self.clock = ComputeClock(modules, events=_events())
                self.stage = session.peer_class()
                if session.generation.rank == 0 and session.store is not None:
                    session.control.publish_stragglers(control.StragglerPolicy(cfg.factor, cfg.window))
        listen(self.requested)

    def after_step(self, step: int) -> None:
        """``step`` completed: its compute time goes out with the next heartbeat; a requested
        handover happens now."""
        s = self.session
        if self.clock is not None:
            sample = self.clock.take(step)
            if sample is not None:
                s.heartbeat.report_compute(*sample, stage=self.stage)
        if self.requested.is_set():
            self.retire()

    def interrupted(self) -> None:
        """A recovery began: the step under way will run again; its forwards so far do not count."""
        if self.clock is not None:
            self.clock.take(-1)

    def retire(self) -> None:
        """Hand this rank over: the version just completed protected, then exit."""
        s = self.session
        version = s.step_count()
        committed = None
        if s.mirror is not None:
            committed = s.mirror.flush(s.config.mirror.timeout_s)
        if s.events is not None:
            s.events("handed_over", version=version, committed=committed)
            s.events.close()
        log(f"rank {s.generation.rank}: handed over to a spare at step {version} (the state of step {version} is "
            f"with its holders); this process exits")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(control.HANDED_OVER_EXIT_CODE)

    def close(self) -> None:
        """Training is over: a handover asked from now on is ignored. (At exit Python puts the
        default action back for the signals it handles, which for this one is to end the process:
        a late order would kill a worker that finished.)"""
        if self.clock is not None:
            self.clock.close()
            self.clock = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(control.HANDOVER_SIGNAL, signal.SIG_IGN)


def _events():
    """Timing events on an accelerator (DeepSpeed's abstraction when registered), None on the CPU."""
    from ..accelerator import get as accelerator

    acc = accelerator()
    if acc.device_name() == "cpu":
        return None
    return lambda: acc.Event(enable_timing=True)


def listen(flag: threading.Event) -> None:
    """Set ``flag`` on :data:`hotspare.control.HANDOVER_SIGNAL` (sent by this worker's launcher).
    A handler can only be installed from the main thread: elsewhere a handover order cannot reach
    this process, and the launcher's order falls back to a kill at its bound."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(control.HANDOVER_SIGNAL, lambda signum, frame: flag.set())
