"""A rank's side of stragglers and planned handover (``"stragglers"`` in the config, and the
drain command): its compute time per step goes out with its heartbeat, and when its launcher
says it is to be handed over, it leaves at the next step boundary: the first forward of the
step after the one under way (so a rank asked during the job's last step never leaves: the job
is over, and the others may still run collectives with it after the loop).

The handover reuses the recovery: the retiring rank waits until the mirror round of the step it
completed has committed (its holders and its keeper have that version), says so, and exits
with :data:`hotspare.control.HANDED_OVER_EXIT_CODE`. Its launcher reports the exit as a
handover, not a failure; the coordinator gives the rank to a ready spare; the other ranks, in
the next step's first collective, land on the version the retiring rank completed, so no
iteration is lost (the part of a step they had done is computed again).

An order stands in the generation it was given in. A recovery between the order and the step
boundary (a real failure that may have taken the spare the order counted on) voids it: the worker
reads its orders before it leaves (:meth:`Handover.standing`) and stays when none is for its
current generation; the coordinator asks again in the new one if the reason still holds.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

import torch

from .. import control, env
from ..events import log
from ..stragglers import ComputeClock


class Handover:
    """A worker's compute clock and its retirement flag (one per session, in the training thread)."""

    def __init__(self, session, modules: list, why_not: str | None, entry: list = ()):
        """``modules``: whose forward time is the compute time; ``why_not``: why none can be
        measured (None: it can); ``entry``: the modules whose forward begins a step (where a
        standing order is carried out)."""
        self.session = session
        self.requested = threading.Event()
        self.armed = False
        """An order stands: this rank leaves at the next step's first forward."""
        self._entry = [m.register_forward_pre_hook(self._step_begins) for m in entry]
        self._orders = control.ListCursor(control.keys.HANDOVER)
        self._newest = -1  # the newest generation an order for this worker was given in
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
            self.requested.clear()
            self.armed = self.standing()

    def _step_begins(self, module, args) -> None:
        # A training forward only: an evaluation under no_grad (between steps, or after the loop
        # of a script that does not use steps()) does not carry the rank away.
        if self.armed and torch.is_grad_enabled():
            self.retire()

    def disarm(self) -> None:
        """The loop is over (``steps`` ended): an order not carried out yet is dropped."""
        self.armed = False

    def standing(self) -> bool:
        """Whether an order for this worker stands in its current generation (the job's signed
        ``handover/<i>`` entries). Without a control store (not under hotspare-run) the signal is
        the order."""
        s = self.session
        if s.store is None:
            return True
        me = os.environ.get(env.HOTSPARE_WORKER_ID, "")
        for order in s.control.handovers(self._orders)[0]:
            if order.worker == me:
                self._newest = max(self._newest, order.generation)
        if self._newest == s.generation.index:
            return True
        if self._newest > s.generation.index:  # asked in the generation this rank is about to join
            self.requested.set()  # (its step fails, and the next one completes there)
            return False
        log(f"rank {s.generation.rank}: a handover was asked in generation {self._newest}, and a recovery came "
            f"before this step boundary (generation {s.generation.index} now): the order is void and this rank "
            f"stays; the coordinator asks again if it still stands")
        return False

    def interrupted(self) -> None:
        """A recovery began: the step under way will run again; its forwards so far do not count.
        An order not carried out yet is void (it stood in the generation being left)."""
        self.armed = False
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
        self.armed = False
        for h in self._entry:
            h.remove()
        self._entry = []
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
