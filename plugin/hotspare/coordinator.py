"""The coordinator: node 0's launcher turns what the workers and launchers report (failures,
spares, survivors that left a generation, node heartbeats) into the next generation's plan:
which spare takes which rank, or why the job cannot go on.

It reads and writes only the control store (keys in :mod:`hotspare.control`), so it is tested
in one process with no workers (tests/test_launch.py); the choice of spares itself is the pure
:func:`hotspare.control.choose_spares`.
"""
from __future__ import annotations

import collections
import dataclasses
import signal
import sys
import time
from collections.abc import Callable

from . import control
from .drain import Drains
from .spares import Spares
from .stragglers import StragglerWatch


UNFIT_STOP = 2
"""Spares whose set-up fails with the same message (``unfit/<wid>``) before the job stops."""
MAX_FAILED_TAKEOVERS = 3
"""Spares in a row that may fail to take one rank (each before its generation caught up) before
the job stops: one that fails at every takeover (a bug in the rank's build or restore, a broken
node) would otherwise be replaced by its successor, and that by its own, for ever."""


TAKEOVER_LIVED_S = 300.0
"""A promoted spare whose generation formed (every rank arrived) and that then lived this long
took its rank, even with no ``caught_up/<g>`` (a loop that never reports it, a replay of many
iterations): its failure is counted as any failure. Not tied to ``--successor-wait-s``, which
may be 0."""


def _log(msg: str) -> None:
    print(f"[hotspare-run] {msg}", file=sys.stderr, flush=True)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "error exit"


class Coordinator:
    """Node 0's planner. ``spec`` is the job's launch spec (a ``hotspare.launch.LaunchSpec``),
    ``store`` the control store, ``port`` the store's port (named in messages)."""

    def __init__(self, spec, store, world_size: int, port: int, clock: Callable[[], float] = time.monotonic):
        self.spec, self.world_size, self.port = spec, world_size, port
        if not isinstance(store, control.ControlStore):
            raise TypeError("the coordinator reads and writes the control store through a ControlStore "
                            "(hotspare.control), which signs and checks every value")
        self.store = store
        self.clock = clock
        """Seconds, monotonic: every deadline of the coordinator's is read from it (tests drive one)."""
        self.generation = 0
        """The newest plan's generation."""
        self._fail_cursor = control.ListCursor(control.keys.FAIL)
        self._spare_cursor = control.ListCursor(control.keys.SPARE)
        self._wait_cursor = control.ListCursor(control.keys.WAIT)
        self._pending: list[control.Failure] = []
        self._pending_since = 0.0
        self._waiting: dict[int, dict[str, control.Waiting]] = {}  # generation -> worker -> report
        self._stall_since: float | None = None
        self._killed: set[str] = set()
        self._prepared: dict[int, str] = {}  # rank -> spare told to build its engine
        self._node_beats: dict[int, tuple[int, float]] = {}  # node -> (beat, when it last went up)
        self._lost_nodes: set[int] = set()
        self._waiting_for_spares = False
        self._alarmed: set[int] = set()  # generations whose workers were told that it failed
        self._alarm_at: dict[int, float] = {}  # a failed generation -> when, until its members were checked
        self._failed: set[str] = set()  # workers a launcher reported failed
        self._promoted: dict[str, tuple[int, int, float]] = {}  # spare -> (rank, generation, when) it was promoted
        self._failed_takeovers: dict[int, list[str]] = {}  # rank -> its spares, in a row, whose takeover failed
        self._unfit: dict[str, list[str]] = {}  # message -> spares whose set-up failed so (unfit/<wid>)
        self.stragglers, self.drains = StragglerWatch(store, clock, _log), Drains(store, spec.node_of_worker, _log)
        self.spares = Spares(store, {spec.node_of_rank(r) for r in range(world_size)},
                             lambda: self._lost_nodes | self.drains.nodes, _log)

    def _follow(self) -> None:
        """A plan written by someone else (a worker's abort) moves the generation too."""
        while self.store.superseded(self.generation):
            self._alarm()
            self.generation += 1

    def _alarm(self) -> None:
        """Generation ``self.generation`` failed: tell each of its workers (``alarm/<g>/<wid>``),
        so that those still training, or blocked in a collective on a peer whose sockets have
        not closed yet (a dying process's memory is torn down first), leave it at once. Once
        per generation; one store request for all of them."""
        g = self.generation
        if g in self._alarmed:
            return
        self._alarmed.add(g)
        self._alarm_at[g] = self.clock()
        self.store.alarm(g, list(self._current_plan().workers.values()))

    @property
    def busy(self) -> bool:
        """A failure waits for its plan (the launcher then looks more often)."""
        return bool(self._pending)

    def step(self) -> None:
        """One look: new spares, failures and reports in; the next generation's plan out when due."""
        self._follow()
        self._check_nodes()
        spares, _ = self.store.spares(self._spare_cursor)
        self.spares.add(spares)
        failures, _ = self.store.failures(self._fail_cursor)
        for failure in failures:
            self._failed.add(failure.worker)
            self.spares.drop({failure.worker})
            self._prepared = {r: w for r, w in self._prepared.items() if w != failure.worker}
            if failure.rank < 0:
                # A spare that died after the plan promoted it but before its launcher saw the plan.
                rank = self._current_plan().rank_of(failure.worker)
                failure = dataclasses.replace(failure, rank=-1 if rank is None else rank)
            self._count_takeover(failure)
            self.spares.note_slow(failure, self.spec.node_of_worker(failure.worker), self.stragglers.asked)
            if failure.rank >= 0:
                if not self._pending:
                    self._pending_since = self.clock()
                self._pending.append(failure)
                self._prepare(failure.rank, failure.worker)
                self._alarm()
        reports, _ = self.store.waiting(self._wait_cursor)
        for report in reports:
            self._waiting.setdefault(report.generation, {})[report.worker] = report
            if report.generation == self.generation:
                self._alarm()  # a survivor left: nobody need wait out a collective timeout
        if not self._pending:
            self._find_stalled()
        self._kill_stuck_members()
        if not self._pending:
            self.drains.look(plan := self._current_plan(), self._can_take)  # ranks moved on purpose
            self.stragglers.look(plan, self._can_take, settling=lambda: self.spares.starting(self.clock()))
        if not self._pending or (self.clock() - self._pending_since < self.spec.settle_s
                                 and not self._all_accounted()):
            return
        self._stall_since = None
        failures, self._pending = self._pending, []
        previous = self._current_plan()
        workers = dict(previous.workers)
        ready = self.spares.ready()
        dead = {f.rank: self.spec.node_of_worker(f.worker) for f in failures}  # where its device and keeper are
        # A spare already building its engine for a rank keeps that rank.
        kept = {r: w for r, w in self._prepared.items() if r in dead and any(s[0] == w for s in ready)}
        rest = self.spares.choose({r: n for r, n in dead.items() if r not in kept},
                                  [s for s in ready if s[0] not in kept.values()])
        choice = None if rest is None else {**kept, **rest}
        g = self.generation + 1
        raised = [f for f in failures if f.reason == "exit" and f.code > 0]
        early = bool(raised) and not self.store.trained()
        if not early and choice is None and len(self.spares.registered) >= len(dead) and \
                self.clock() - self._pending_since < self.spec.store_timeout_s:
            # Enough spares exist but some are still starting (imports, model build): wait for them.
            self._pending = failures + self._pending
            return
        if not early and choice is None and self.clock() - self._pending_since < self.spec.spare_wait_s:
            # Configured to wait for spares: from a replacement node (hotspare-run --spares-only).
            if not self._waiting_for_spares:
                self._waiting_for_spares = True
                _log(f"{len(dead)} rank(s) need a spare and {len(ready)} are ready: waiting up to "
                     f"{self.spec.spare_wait_s:.0f} s for more (start `hotspare-run --spares-only --node-rank "
                     f"<new index> --spares-per-node N --master-addr {self.spec.master_addr} --master-port "
                     f"{self.port} ...` on a replacement node)")
            self._pending = failures + self._pending
            return
        self._waiting_for_spares = False
        repeated = {r: w for r, w in self._failed_takeovers.items() if r in dead and len(w) >= MAX_FAILED_TAKEOVERS}
        unfit = next(((m, w) for m, w in self._unfit.items() if len(w) >= UNFIT_STOP), None)
        if early:
            # A rank raised before the job's first step: most likely the script, its config or its
            # environment, which a spare running the same script would meet too; and nothing is
            # lost by stopping now. (A rank killed before the first step still gets a spare.)
            lost = ", ".join(f"rank {f.rank} ({describe_exit(f.code)})" for f in raised)
            reason = (f"{lost} exited with an error before the job's first step: most likely a fault in the script, "
                      f"its config or its environment, which a spare would meet too; see the first traceback above")
            plan = control.Plan(g, self.world_size, workers, failures=[dataclasses.asdict(f) for f in failures],
                                abort=reason, failures_read=self._fail_read)
            _log(f"cannot recover: {reason}")
        elif unfit is not None:
            reason = f"spares {', '.join(unfit[1])} failed the same way after taking a rank: {unfit[0]}"
            plan = control.Plan(g, self.world_size, workers, failures=[dataclasses.asdict(f) for f in failures],
                                abort=reason, failures_read=self._fail_read)
            _log(f"cannot recover: {reason}")
        elif repeated:
            reason = "; ".join(
                f"rank {r}: {len(w)} spares in a row ({', '.join(w)}) failed before their generation caught up" for r, w
                in sorted(repeated.items())) + (" (a spare cannot take this rank: see those workers' logs; a spare "
                                               "that fails the same way each time is not a transient fault)")
            plan = control.Plan(g, self.world_size, workers, failures=[dataclasses.asdict(f) for f in failures],
                                abort=reason, failures_read=self._fail_read)
            _log(f"cannot recover: {reason}")
        elif choice is None:
            lost = ", ".join(f"rank {f.rank} ({describe_exit(f.code) if f.reason == 'exit' else 'hung'})"
                             for f in failures)
            per_node = max(collections.Counter(dead.values()).values())
            local = self.spares.local_only(ready)
            bound = " (on an accelerator a spare takes only a rank of its own node)" if local else ""
            reason = (f"{lost} failed and only {len(ready)} ready spare(s) remain{bound}; to survive {len(dead)} "
                      f"failures at once ({per_node} on one node) start hotspare-run with --spares-per-node >= "
                      f"{max(per_node, self.spec.spares_per_node + 1)}")
            plan = control.Plan(g, self.world_size, workers, failures=[dataclasses.asdict(f) for f in failures],
                                abort=reason, failures_read=self._fail_read)
            _log(f"cannot recover: {reason}")
        else:
            for rank, wid in choice.items():
                workers[str(rank)] = wid
                self._prepared.pop(rank, None)
            self.spares.drop(set(choice.values()))
            plan = control.Plan(g, self.world_size, workers, replaced={str(r): w for r, w in choice.items()},
                                failures=[dataclasses.asdict(f) for f in failures], failures_read=self._fail_read)
            now = self.clock()
            self._promoted.update({w: (r, g, now) for r, w in choice.items()})
            _log(f"generation {g}: " + ", ".join(f"rank {r} -> spare {w}" for r, w in choice.items()))
        self._alarm()  # (already done when a failure or a report came in)
        self.store.send_orders(plan)
        self.generation = g

    @property
    def _fail_read(self) -> int:
        """Every ``fail/`` entry below this index was read (a plan's ``failures_read``)."""
        return self._fail_cursor.next

    def _count_takeover(self, failure: control.Failure) -> None:
        """A promoted spare that fails before its generation caught up (rank 0 back at the step the
        failure interrupted, with a step completed: ``caught_up/<g>``) failed its takeover, whether
        it died in its build, at the rendezvous or in its restore. One that fails later is counted
        as any failure, and its rank starts over; so is one whose generation formed and that
        lived ``TAKEOVER_LIVED_S`` since its promotion."""
        promoted = self._promoted.pop(failure.worker, None)
        if promoted is None:
            return
        message = self.store.unfit(failure.worker)
        if message is not None:
            self._unfit.setdefault(message, []).append(failure.worker)
        rank, g, since = promoted
        lived = self.clock() - since >= TAKEOVER_LIVED_S
        # The generation it was promoted to, or a later one it was carried into (its first was
        # superseded: another failure), caught up: the takeover itself went through.
        for gg in range(g, self.generation + 1):
            plan = self._plan_of(gg)
            if plan.abort or failure.worker not in plan.workers.values():
                break
            if self.store.caught_up(gg) or (lived and self._formed(gg, plan.world_size)):
                self._failed_takeovers.pop(rank, None)
                return
        self._failed_takeovers.setdefault(rank, []).append(failure.worker)

    def _formed(self, g: int, world_size: int) -> bool:
        """Every rank of generation ``g`` arrived (``generation.arrive``'s keys)."""
        return self.store.arrived(g, world_size)

    def _all_accounted(self) -> bool:
        """Every worker of the current generation has failed or reported that it left it: no other
        failure can still be on its way, so the settle window need not run out."""
        seen = {f.worker for f in self._pending} | set(self._waiting.get(self.generation, {}))
        return set(self._current_plan().workers.values()) <= seen

    def _prepare(self, rank: int, replaces: str = "") -> None:
        """Tell a ready spare at once which rank it will take, so that it builds that rank's engine
        while the coordinator settles and plans (the plan then gives it that rank)."""
        if rank in self._prepared:
            return
        ready = [s for s in self.spares.ready() if s[0] not in self._prepared.values()]
        node = self.spec.node_of_worker(replaces) if replaces else self._node_of(rank)
        pick = self.spares.choose({rank: node}, ready)
        if pick is None:
            return
        self._prepared[rank] = pick[rank]
        prepare = control.Prepare(rank, self.world_size, self.generation + 1, replaces)
        self.store.send_prepare(pick[rank], prepare)
        self.store.wake(pick[rank])

    def _can_take(self, rank: int) -> bool:
        return self.spares.can_take(rank, self._node_of(rank))

    def _node_of(self, rank: int) -> int:
        """The node ``rank`` runs on now (a spare elsewhere may hold it since a handover)."""
        wid = self._current_plan().workers.get(str(rank))
        return self.spec.node_of_worker(wid) if wid else self.spec.node_of_rank(rank)

    def _find_stalled(self) -> None:
        """Survivors left the current generation but no launcher reported a failure: a rank is stuck
        (alive and beating, but not in the collective its peers timed out in), or the fault was
        transient. Who has not reported within ``stall_grace_s`` is killed (then replaced like any
        failure); when every active worker reported, the same workers form the next generation."""
        g = self.generation
        waiting = self._waiting.get(g)
        if not waiting or self.store.superseded(g):
            return
        now = self.clock()
        if self._stall_since is None:
            self._stall_since = now
        workers = self._current_plan().workers
        active = set(workers.values())
        missing = sorted(active - set(waiting) - self._killed)
        if not missing and not (active & self._killed):
            plan = control.Plan(g + 1, self.world_size, dict(workers), failures_read=self._fail_read)
            _log(f"generation {g + 1}: every rank saw a failure and none died (a transient fault); "
                 f"rebuilding with the same workers")
            self.store.write_plan(plan)
            self.generation = g + 1
            self._stall_since = None
            return
        if missing and now - self._stall_since > self.spec.stall_grace_s:
            waited = max((r.waited_s for r in waiting.values() if r.timed_out), default=0.0)
            for wid in missing:
                self._kill(wid, waited + now - self._stall_since,
                           f"did not report the failure its peers saw within {self.spec.stall_grace_s} s")

    def _kill(self, wid: str, detect_s: float, why: str) -> None:
        """Have ``wid``'s launcher kill it as stuck (``kill/``); its failure is then reported as any."""
        _log(f"worker {wid} {why}: killing it as stuck")
        self.store.ask_kill(wid, detect_s)
        self._killed.add(wid)

    def _kill_stuck_members(self) -> None:
        """A member of a failed generation that has neither failed nor said it left is stuck in
        it: alive and beating, but in a wait that its broken connections did not end (seen on
        CPU, gloo: an all-gather or an isend that waited out the whole collective timeout, 120 s,
        after the worker's own sockets were shut down; meanwhile the next generation's
        rendezvous timed out on every other member, and the job failed). It is killed, and the
        next plan replaces it like any failed rank, once the others' rendezvous is four fifths
        through (``rendezvous_timeout_s`` of their reports; ``stall_grace_s`` at least): not
        sooner, because a stuck wait that ends at its own timeout before then keeps the member
        and the copies of others' state it holds (killing it at once lost the only copy of a
        rank in a double fault of the fault matrix). Only generations that formed (every rank
        arrived) are looked at: a member of one that did not is in the rendezvous, which the
        next plan ends (:class:`hotspare.generation.Superseded`)."""
        now = self.clock()
        for g, since in list(self._alarm_at.items()):
            said = [r.rendezvous_timeout_s for r in self._waiting.get(g, {}).values() if r.rendezvous_timeout_s > 0]
            if now - since <= max(self.spec.stall_grace_s, 0.8 * min(said, default=0.0)):
                continue
            del self._alarm_at[g]  # one look per failed generation
            plan = self._plan_of(g)
            if not self._formed(g, plan.world_size):
                continue
            left = set(self._waiting.get(g, {}))
            for wid in sorted(set(plan.workers.values()) - left - self._failed - self._killed):
                self._kill(wid, now - since, f"is still in generation {g} {now - since:.1f} s after it failed (the "
                           f"others' rendezvous gives up at {min(said, default=0.0):.0f} s, --stall-grace-s="
                           f"{self.spec.stall_grace_s})")

    def _plan_of(self, generation: int) -> control.Plan:
        if generation == 0:
            return control.Plan(0, self.world_size, {str(r): control.active_id(r) for r in range(self.world_size)})
        return self.store.plan(generation)

    def _current_plan(self) -> control.Plan:
        return self._plan_of(self.generation)

    def _check_nodes(self) -> None:
        """Node 0: a node whose launcher stopped beating for ``node_timeout_s`` is lost; every rank
        it held fails (reason 'node') and its spares are given up. A node is watched from its
        first beat on (launchers may start minutes apart under a scheduler)."""
        # Every launched node but this one, and any node that brought spares (a replacement).
        nodes = set(range(1, self.spec.nnodes)) | {n for _, n in self.spares.registered if n >= self.spec.nnodes}
        if not nodes or self.spec.logical_nodes > 1:
            return
        now = self.clock()
        for n in sorted(nodes):
            if n in self._lost_nodes:
                continue
            beat = self.store.node_beats(n)
            seen = self._node_beats.get(n)
            # Only a beat past the last one counts: a replayed older one (signed) is not news.
            if beat > 0 and (seen is None or beat > seen[0]):
                self._node_beats[n] = (beat, now)
            elif seen is not None and now - seen[1] > self.spec.node_timeout_s:
                self._lose_node(n, now - seen[1])

    def _lose_node(self, node: int, silent_s: float) -> None:
        self._lost_nodes.add(node)
        self.spares.drop_node(node)
        plan = self._current_plan()
        lost = sorted((int(r), wid) for r, wid in plan.workers.items() if self.spec.node_of_worker(wid) == node)
        _log(f"node {node} lost: its launcher has not beaten for {silent_s:.1f} s (down, or cut off from node 0); "
             f"its rank(s) {[r for r, _ in lost]} fail")
        for rank, wid in lost:
            failure = control.Failure(worker=wid, rank=rank, code=-signal.SIGKILL, reason="node",
                                      wall_time=time.time(), detect_s=silent_s)
            self.store.report_failure(failure)
