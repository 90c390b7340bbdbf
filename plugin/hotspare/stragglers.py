"""Slow ranks: each rank's compute time per step, and the test that names a straggler.

In synchronous training every rank waits for the slowest at each collective, so a step's wall
time says nothing about which rank is slow. What does is the time a rank spends computing, not
waiting. The proxy here is the **forward pass** of the host's model, timed by hooks on its
top-level module(s):

- DeepSpeed ZeRO 0/1/2: the forward runs no collective (gradients are reduced in the backward,
  parameters are whole), so its time is the rank's own compute. The backward is about twice
  the forward and scales with it; its reductions are where the fast ranks wait, so it is left out.
- megatron-core without tensor parallelism: each model chunk's forward runs no collective (the
  pipeline's sends and receives are between the chunks' forwards, in the schedule), so the sum
  of a rank's chunk forwards in an iteration is its compute. Ranks are compared with the other
  data-parallel replicas of the same pipeline stage only (stages differ in what they compute).
- DeepSpeed ZeRO 3: the forward gathers each module's parameters in DeepSpeed's forward
  pre-hook, which waits there for the other ranks. So the leaf modules (no children: where the
  matmuls are) are timed one by one, from a pre-hook registered after DeepSpeed's (the gather
  has completed) to their forward's end (:func:`leaves`). What runs in a parent's own forward
  outside its children (a residual add) is left out: a proxy that scales with the compute.
- Not measured: tensor parallelism (its layers all-reduce inside their own forward): there
  every rank's forward time rises together and nothing tells the slow rank apart.
  :func:`measurable` says why.

On an accelerator the forward is timed with events on the current stream (read one step later,
when they have completed), not with the host clock (kernels are launched asynchronously).

The test (:func:`stragglers`) is a pure function of the reports: a rank is a straggler when, in
each of the last ``window`` steps that every one of its peers reported, its compute time was above
``factor`` times the median of its peers' for that step. One slow step (a garbage collection, a
checkpoint write) is not enough.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Hashable, Iterable, Mapping

from . import control


def measurable(tensor_parallel: int = 1) -> str | None:
    """Why a job's compute time cannot be told apart from its waits (None: it can)."""
    if tensor_parallel > 1:
        return f"tensor parallelism ({tensor_parallel}) all-reduces inside the forward (every rank waits there)"
    return None


def leaves(module) -> list:
    """The modules under ``module`` (itself included) with no children: timed one by one where a
    parent's forward waits for something (ZeRO 3's parameter gathers, in each module's pre-hook)."""
    return [m for m in module.modules() if next(m.children(), None) is None]


class ComputeClock:
    """Times the forward passes of ``modules`` and sums them per step.

    ``events``: a callable returning a timing event (``get_accelerator().Event(enable_timing=True)``)
    on an accelerator, None on the CPU (``clock`` then reads the time). :meth:`take` ends a step and returns the compute seconds of
    the previous step whose events completed (on the CPU: of the step just ended).
    """

    def __init__(self, modules: Iterable, events=None, clock=time.perf_counter):
        self._events, self._clock = events, clock
        self._open: list = []  # forward intervals of the step under way: (start, end)
        self._pending: tuple[int, list] | None = None  # accelerator: a step whose events may still run
        self._start = None
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._begin))
            self._handles.append(m.register_forward_hook(self._end))

    def _now(self):
        if self._events is None:
            return self._clock()
        event = self._events()
        event.record()
        return event

    def _begin(self, module, args) -> None:
        if self._start is None:  # nested or repeated modules: the outermost interval counts
            self._start = (module, self._now())

    def _end(self, module, args, output) -> None:
        if self._start is not None and self._start[0] is module:
            self._open.append((self._start[1], self._now()))
            self._start = None

    def take(self, step: int) -> tuple[int, float] | None:
        """End step ``step``: (a step, its compute seconds), or None when none is ready yet."""
        intervals, self._open, self._start = self._open, [], None
        if self._events is None:
            return (step, sum(b - a for a, b in intervals)) if intervals else None
        ready, self._pending = self._pending, (step, intervals) if intervals else None
        if ready is None:
            return None
        done_step, done = ready
        done[-1][1].synchronize()  # recorded a step ago: complete, or nearly
        return done_step, sum(a.elapsed_time(b) for a, b in done) / 1000.0

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def stragglers(reports: Mapping[int, Mapping[int, float]], peers: Mapping[int, Hashable], factor: float,
               window: int) -> dict[int, float]:
    """Ranks that computed slower than ``factor`` x their peers' median in each of the last
    ``window`` steps all their peers reported, with how many times slower (the smallest ratio of
    those steps).

    ``reports``: rank -> {step: compute seconds}. ``peers``: rank -> its peer class (ranks are
    compared within a class: a pipeline stage); a class needs at least 3 ranks (with 2, which one
    is slow is a guess).
    """
    classes: dict[Hashable, list[int]] = {}
    for rank in reports:
        classes.setdefault(peers.get(rank, 0), []).append(rank)
    found = {}
    for ranks in classes.values():
        if len(ranks) < 3:
            continue
        common = set.intersection(*(set(reports[r]) for r in ranks))
        last = sorted(common)[-window:]
        if len(last) < window:
            continue
        for rank in ranks:
            ratios = []
            for step in last:
                others = statistics.median(reports[r][step] for r in ranks if r != rank)
                mine = reports[rank][step]
                ratios.append(mine / others if others > 0 else (float("inf") if mine > 0 else 1.0))
            if min(ratios) > factor:
                found[rank] = min(ratios)
    return found


LOOK_S = 0.5
"""How often the coordinator reads the workers' compute times (they come with their heartbeats)."""


class StragglerWatch:
    """The coordinator's look for stragglers (node 0's launcher, through the control store).

    Idle until rank 0 publishes the job's :class:`~hotspare.control.StragglerPolicy` (the config's
    ``stragglers`` section is on). Then, every :data:`LOOK_S`, it reads each current worker's
    latest compute times and runs :func:`stragglers`; a straggler is asked to hand its rank over
    (``handover/<i>``) when a ready spare can take that rank, one handover at a time; when none
    can, it says so once and nothing else happens. An order stands in the generation it was
    given in: a recovery before the straggler left voids it (the worker does not leave), and the
    straggler is asked again in the new generation if it still is one and a spare can take it.

    Only steps with nothing of hotspare's own in them count: after a recovery (the rebuild, a
    replayed step) and while a spare starts (a successor's imports and model build compete for
    its node's CPUs), the steps reported so far are set aside, and a straggler needs ``window``
    fresh ones. On 2 shared cores a healthy rank was otherwise taken for slow (2.2x for 3 steps)
    while a successor started beside it.
    """

    def __init__(self, store, clock, log):
        self.store, self.clock, self.log = store, clock, log
        self.policy = None
        self._next = 0.0
        self._asked: dict[str, int] = {}  # worker asked to hand over -> the generation it was asked in
        self._said: set[str] = set()  # stragglers that no spare could take (said once)
        self._generation = 0
        self._fresh_after = -1  # only steps after this one count (see the class's doc)

    @property
    def asked(self) -> set[str]:
        """The workers asked to hand over as stragglers."""
        return set(self._asked)

    def look(self, plan, can_take, settling=lambda: False) -> None:
        """``plan``: the current generation's; ``can_take(rank)``: whether a ready spare can take it;
        ``settling()``: whether a spare is starting (the steps meanwhile do not count; asked only
        when a look is due)."""
        now = self.clock()
        if now < self._next:
            return
        self._next = now + LOOK_S
        if self.policy is None:
            self.policy = self.store.stragglers()
            if self.policy is None:
                return
        if any(self._asked.get(w) == plan.generation for w in plan.workers.values()):
            return  # one at a time: the last one asked has not left yet
        reports, peers, workers = {}, {}, {}
        for rank, wid in plan.workers.items():
            compute = self.store.compute(wid)
            if compute is not None:
                reports[int(rank)] = {s["step"]: s["seconds"] for s in compute.samples}
                peers[int(rank)], workers[int(rank)] = compute.stage, wid
        if plan.generation != self._generation or settling():
            self._generation = plan.generation
            self._fresh_after = max((s for steps in reports.values() for s in steps), default=self._fresh_after)
            return
        reports = {r: {s: t for s, t in steps.items() if s > self._fresh_after} for r, steps in reports.items()}
        found = stragglers(reports, peers, self.policy.factor, self.policy.window)
        for rank, ratio in sorted(found.items(), key=lambda kv: -kv[1]):
            wid = workers[rank]
            detail = (f"{ratio:.1f}x its peers' median compute time in each of its last {self.policy.window} "
                      f"steps (stragglers.factor={self.policy.factor:g})")
            if not can_take(rank):
                if wid not in self._said:
                    self._said.add(wid)
                    self.log(f"rank {rank} ({wid}) is a straggler: {detail}; no ready spare can take it, so it stays")
                continue
            again = " (asked again: a recovery voided the last order)" if wid in self._asked else ""
            self._asked[wid] = plan.generation
            self.log(f"rank {rank} ({wid}) is a straggler: {detail}; it hands its rank to a spare at its next step "
                     f"boundary{again}")
            self.store.ask_handover(control.Handover(wid, rank, "straggler", detail, plan.generation))
            return
