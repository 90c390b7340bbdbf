"""The worker's side of the control plane: heartbeats, a spare's wait, and waiting for plans.

See :mod:`hotspare.control` for the keys.
"""
from __future__ import annotations

import collections
import faulthandler
import os
import sys
import threading

from . import control, env
from .errors import HotspareError
from .generation import store_from_env


def enable_stack_dumps() -> None:
    """Dump every thread's stack to stderr on :data:`hotspare.control.STACKS_SIGNAL` (a worker
    under hotspare-run)."""
    try:
        faulthandler.register(control.STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):
        pass  # no usable stderr (it has no descriptor): the kill then just says where in the step


def role() -> str:
    """'active' or 'spare' (a process not started by hotspare-run is active)."""
    value = os.environ.get(env.HOTSPARE_ROLE, "active")
    if value not in ("active", "spare"):
        raise RuntimeError(f"{env.HOTSPARE_ROLE}={value!r}: expected 'active' or 'spare'")
    return value


def worker_id() -> str:
    wid = os.environ.get(env.HOTSPARE_WORKER_ID)
    if wid:
        return wid
    return control.active_id(env.env_int("RANK", 0))


class Heartbeat:
    """Beats ``hb/<wid>`` every ``interval_s`` from a thread with its own store connection, and
    listens for the coordinator's alarm from another.

    The launcher kills a worker whose counter stops moving for ``timeout_s`` (published once
    in ``hb/<wid>/timeout``). ``close`` writes -1: a worker that says goodbye is not hung.
    The beat thread only waits on an Event and does one store write per beat, so it keeps beating
    while the training thread is blocked inside a collective (which releases the GIL); at 16,384
    workers beating every 0.5 s that is 32,768 requests a second to the store, so a beat asks
    nothing else of it.

    The alarm thread blocks in the store (a connection of its own) on ``alarm/<g>/<wid>`` for
    the generation g this worker trains in (:meth:`watch`); the coordinator sets it the moment
    it learns that g failed.
    """

    def __init__(self, wid: str, interval_s: float, timeout_s: float, store=None):
        self.wid, self.interval_s = wid, interval_s
        enable_stack_dumps()
        self._store = control.ControlStore(store if store is not None else store_from_env())
        self._store.start_beating(wid, timeout_s)
        self._beat = 0
        self._compute: collections.deque = collections.deque(maxlen=COMPUTE_SAMPLES)
        self._compute_stage: int | None = None  # set by report_compute; None: nothing new to send
        self._lock = threading.Condition()
        self._watching: int | None = None
        self._on_superseded = None
        self._listening: int | None = None  # the generation whose alarm key the alarm thread waits on
        self._stop = threading.Event()
        self._alarm_store = control.ControlStore(store_from_env()) if store is None else None
        self._alarm_thread = None
        if self._alarm_store is not None:
            self._alarm_thread = threading.Thread(target=self._listen, name=f"hotspare-alarm-{wid}", daemon=True)
            self._alarm_thread.start()
        self._thread = threading.Thread(target=self._run, name=f"hotspare-heartbeat-{wid}", daemon=True)
        self._thread.start()

    @property
    def listening(self) -> int | None:
        """The generation whose alarm the alarm thread waits for now (None: not waiting yet)."""
        return self._listening

    def watch(self, generation: int | None, on_superseded=None) -> None:
        """While this worker trains in ``generation``, call ``on_superseded()`` (from another
        thread) as soon as the coordinator says that generation failed (its alarm) or plans the
        next one: a peer may be dying, lost or cut off while this worker is blocked on it in a
        collective whose sockets have not broken yet (a dead process's connections reset only
        after the kernel tore down its memory; a partition sends no reset at all). None: stop
        watching (the worker is recovering)."""
        with self._lock:
            self._watching, self._on_superseded = generation, on_superseded
            self._lock.notify_all()

    def report_compute(self, step: int, seconds: float, stage: int = 0) -> None:
        """Step ``step`` took ``seconds`` of compute (hotspare.stragglers): sent with the next beat."""
        with self._lock:
            self._compute.append(control.Sample(step, seconds))
            self._compute_stage = stage

    def _send_compute(self) -> None:
        with self._lock:
            stage, self._compute_stage = self._compute_stage, None
            samples = list(self._compute)
        if stage is not None:
            self._store.report_compute(self.wid, control.Compute(stage, [vars(s) for s in samples]))

    def _fire(self, generation: int) -> None:
        with self._lock:
            if self._watching != generation:
                return  # recovering already, or already past it
            self._watching = None
            callback = self._on_superseded
        if callback is not None:
            callback()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat += 1
            try:
                self._store.beat(self.wid, self._beat)
                self._send_compute()  # a second request, only while stragglers are looked for
                g = self._watching
                # With the alarm thread this check is not needed: the coordinator sets every
                # worker's alarm before it writes a plan. Without it (a store passed in, whose
                # connection a blocking wait would hold, or an alarm thread that lost its store
                # connection) the beat looks for the next plan: one more request per beat.
                listening = self._alarm_thread is not None and self._alarm_thread.is_alive()
                if g is not None and not listening and self._store.superseded(g):
                    self._fire(g)
            except Exception:  # noqa: BLE001 - the launcher is gone: nobody is listening
                return

    def _listen(self) -> None:
        g = 0
        while True:
            with self._lock:
                while not self._stop.is_set() and (self._watching is None or self._watching < g):
                    self._lock.wait()
                if self._stop.is_set():
                    return
                g = self._watching
                self._listening = g
            try:
                self._alarm_store.wait_for_alarm(g, self.wid)
            except Exception:  # noqa: BLE001 - the store is gone (the job ended or its launcher died)
                return
            if self._stop.is_set():
                return
            self._fire(g)
            g += 1

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
            listening = self._listening
        if listening is not None:
            try:  # ends the alarm thread's wait (only this worker waits on its key)
                self._store.end_alarm_wait(listening, self.wid)
            except Exception:  # noqa: BLE001 - the store is gone: so is the wait
                pass
        self._thread.join(timeout=self.interval_s + 5)
        if self._alarm_thread is not None:
            self._alarm_thread.join(timeout=5)
        try:
            self._store.say_goodbye(self.wid)
        except Exception:  # noqa: BLE001
            pass


COMPUTE_SAMPLES = 32
"""Compute times a worker sends with its beats (the newest): more than any straggler window needs
between two of the coordinator's looks."""


class Shutdown(HotspareError):
    """The job ended while this spare waited; the spare exits cleanly."""


def wait_for_order(store: control.ControlStore, wid: str, prepare: bool = False) -> "control.Plan | control.Prepare":
    """A spare: announce readiness, then wait (without limit) for a takeover order.

    With ``prepare``, returns a :class:`control.Prepare` as soon as the coordinator names the rank
    this spare will take (before the plan); call again (without) for the order itself.
    Raises :class:`Shutdown` when the job ends first. Losing the store (the launcher died)
    raises the store's error, so an orphaned spare does not wait forever.
    """
    # On an accelerator a spare can take only a rank of its own node: the dead rank's device is
    # the one it will have (every device of another node belongs to a live rank).
    store.set_ready(wid, control.SPARE_LOCAL if env.configure_accelerator() != "cpu" else control.SPARE_ANY)
    while True:
        # Cleared before the checks: news written after them sets it again and ends the wait at
        # once; news written before them is seen by them (the writers set wake/<wid> last).
        store.clear_wake(wid)
        g = store.order_for(wid)
        if g is not None:
            return store.plan(g)
        if prepare:
            early = store.prepare_for(wid)
            if early is not None:
                return early
        if store.is_shut_down():
            raise Shutdown()
        # Blocks in the store (the GIL released: the heartbeat thread beats on). A polled wait
        # added half its interval to every recovery the spare took part in.
        store.wait_for_wake(wid)


def wait_for_plan(store: control.ControlStore, generation: int, timeout_s: float) -> control.Plan:
    """A survivor after a failure: the coordinator's plan for ``generation``."""
    store.wait(control.keys.plan(generation), timeout_s,
               f"the coordinator's plan for generation {generation} (is hotspare-run the launcher?)")
    return store.plan(generation)
