"""Leaving a failed generation and landing in the next: one recovery of one process.

A survivor enters through :func:`recover` (a collective raised, or the coordinator said its
generation failed), a spare through :func:`join_as_spare` (its order came; its host objects are
built for the rank it takes). Both then take part in the coordinator's plan with a
:class:`Landing`: join the new generation, rebuild hotspare's and the host's groups, restore
from the newest version every rank holds (:mod:`.sources`), agree on it, start protecting it
again (:mod:`.protection`) and resume. When a member fails while the generation forms, the
landing leaves that generation too and takes part in the next plan.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import torch
import torch.distributed as dist

from .. import control, report
from ..events import log
from ..generation import Generation, Superseded, join, leave
from ..mirror import Mirror
from ..planning import NoConsistentVersion, choose_version
from ..recovery import RecoveryError, exchange_holdings, is_distributed_error, is_timeout, start_fetch
from ..setupguard import SetupGuard
from ..snapshot import Layout
from ..sockets import abort_nccl
from ..startup import wait_for_takeover
from ..worker import wait_for_plan, worker_id
from . import protection, sources


@dataclasses.dataclass
class CatchUp:
    """Rank 0 after a recovery: until a step of the new generation completes and the count is
    back at the step the failure interrupted, the spares promoted into ``generation`` have not
    yet shown that they train; then ``caught_up/<g>`` tells the launchers to start their
    successor spares (and the coordinator that the spares took their ranks)."""

    generation: int
    failed_at: int
    """The step the failure interrupted (-1 on a spare: it knows none)."""
    landed: int
    """The step the recovery landed on."""

    def reached(self, count: int) -> bool:
        """Whether ``count`` steps taken means the generation caught up."""
        return count > self.landed and count >= self.failed_at


def recover(session, error: BaseException) -> None:
    """A survivor's recovery after ``error``: leave the failed generation at once (tell the
    coordinator, break the connections a peer may wait on, freeze the mirror) and land with the
    coordinator's plan."""
    cfg = session.config.recovery
    if len(session.recoveries) >= cfg.max_recoveries:
        raise RecoveryError(f"{len(session.recoveries)} recoveries done, recovery.max_recoveries="
                            f"{cfg.max_recoveries}: stopping (a failure that keeps recurring is not transient)") \
            from error
    t0 = time.monotonic()
    if session.heartbeat is not None:
        session.heartbeat.watch(None)
    session.alarm.begin_leaving(session.generation.index)
    failed_at = session.step_count()
    # The coordinator first: once every survivor has said so, it plans without waiting out
    # its settle window (the walk for the host's groups comes after).
    report_waiting(session, session.generation.index, error)
    early = 0
    if session.backend == "gloo":
        # Then the peers blocked on this rank in a collective learn of it at once (with NCCL
        # its communicators are aborted first, in break_off, which needs the walk).
        early = session.break_connections()
    session.events("failure_seen", version=failed_at, error=str(error)[:500],
                   error_type=type(error).__name__, timed_out=is_timeout(error))
    log(f"rank {session.generation.rank}: failure seen at step {failed_at}: "
        f"{type(error).__name__}: {str(error)[:200]}")
    landing = Landing(session, session.host_groups(), {"failed_at": failed_at}, t0,
                      retained=session.mirror)  # frozen by break_off; the restore reads what it holds
    broken = early + landing.break_off(session.generation.index, error, reported=True,
                                       already_broken=session.backend == "gloo")
    if session.checkpoints is not None and not session.checkpoints.flush(cfg.rendezvous_timeout_s):
        log(f"rank {session.generation.rank}: the checkpoint writer is still busy after "
            f"{cfg.rendezvous_timeout_s} s; recovering without waiting for it")
    session.events("left", connections_broken=broken, seconds=time.monotonic() - t0)
    landing.run(None, session.generation.index + 1, error)


def join_as_spare(session, plan, rank: int, t_order: float) -> None:
    """A spare whose host objects are built for ``rank`` (on torch's fake group): wait for the
    order if it has not come yet, join the survivors' generation and land with them."""
    records = session.host_groups()
    session.reap(leave(background=True))  # the fake group
    t_built = time.monotonic()
    if plan is None:
        plan = wait_for_takeover(session.control, session.heartbeat)
        if plan.rank_of(worker_id()) != rank:
            raise RecoveryError(f"spare {worker_id()} built rank {rank}'s state as told, but the plan for "
                                f"generation {plan.generation} gives it rank {plan.rank_of(worker_id())}")
    session.events("takeover", generation=plan.generation, replaced=plan.replaced)
    Landing(session, records, {"engine_build_s": t_built - t_order}, t_order).run(plan, plan.generation)
    if session.store is not None:
        plane, wid = session.control, worker_id()
        session.setup_guard = SetupGuard(lambda message: plane.set_unfit(wid, message)).start()


def report_waiting(session, generation: int, error: BaseException) -> None:
    """Tell the coordinator at once that this worker left ``generation``: a failure no launcher
    saw (a peer stuck while it keeps beating) is found from which workers do not say this."""
    timed_out = is_timeout(error)
    cfg = session.config.recovery
    session.control.report_waiting(control.Waiting(
        worker=worker_id(), rank=session.generation.rank, generation=generation, timed_out=timed_out,
        waited_s=cfg.collective_timeout_s if timed_out else 0.0, rendezvous_timeout_s=cfg.rendezvous_timeout_s))


class Landing:
    """One process's way from a failed generation into the next one that forms.

    ``records``: the host's process groups as found before the failed generation's were
    destroyed (re-pointed at each attempt's new groups); ``retained``: a survivor's frozen
    mirror (what it holds of its own and its peers' versions; None on a spare); ``phases``:
    the recovery's measured phases, filled in as they pass.
    """

    def __init__(self, session, records: list, phases: dict, t0: float, retained: Mirror | None = None):
        self.session, self.records, self.phases, self.t0, self.retained = session, records, phases, t0, retained
        self._repointed: list | None = None

    def run(self, plan, generation: int, error: BaseException | None = None) -> None:
        """Take part in ``plan`` (or wait for the plan of ``generation``). When a member fails while
        the new generation forms, leave it and go on with the coordinator's next plan."""
        s = self.session
        cfg = s.config.recovery
        while True:
            if plan is None:
                plan = wait_for_plan(s.control, generation, cfg.rendezvous_timeout_s)
                self.phases.setdefault("plan_s", time.monotonic() - self.t0)
                s.events("plan", generation=plan.generation, replaced=plan.replaced, failures=plan.failures,
                         wait_s=time.monotonic() - self.t0)
                if plan.abort:
                    raise RecoveryError(f"the job cannot recover: {plan.abort}") from error
            self._repointed = None
            try:
                self._take_part(plan)
                return
            except Superseded as exc:
                # Said like any other way out of a generation: the coordinator kills a member of a
                # failed generation that did not say it left (one stuck in it).
                report_waiting(s, plan.generation, exc)
                generation = exc.generation
            except Exception as exc:  # noqa: BLE001 - classified here
                if not is_distributed_error(exc) or not dist.is_initialized():
                    raise  # a bug, or a member that never arrived (the error names it)
                generation = plan.generation + 1
                # The engine points at this attempt's groups once they were re-pointed.
                self.records = self._repointed or self.records
                self.break_off(plan.generation, exc)
            s.events("retry", generation=generation, failed_generation=plan.generation)
            log(f"rank {s.generation.rank}: generation {plan.generation} failed while it formed; "
                f"joining generation {generation}")
            plan = None

    def break_off(self, generation: int, error: BaseException, reported: bool = False,
                  already_broken: bool = False) -> int:
        """Leave ``generation`` at once (a failure in it, or while it formed): tell the coordinator
        (unless ``reported``), abort NCCL, shut down every connection but the store's (unless
        ``already_broken``: a second pass over the descriptors finds none and costs 1-2 ms),
        so that no survivor waits out a collective timeout, freeze the mirror, destroy the
        groups. Returns the connections broken here."""
        s = self.session
        if not reported:
            report_waiting(s, generation, error)
        if dist.is_initialized():
            abort_nccl([r.group for r in self.records])
        broken = 0 if already_broken else s.break_connections()
        if s.mirror is not None:
            s.mirror.stop()
            s.retired_mirrors.append(s.mirror)
            s.mirror = None
        s.groups = ()
        s.reap(leave(background=True))
        return broken

    def _take_part(self, plan) -> None:
        """Join ``plan``'s generation, rebuild every group, restore, restart mirroring (survivor or spare)."""
        s, phases, retained = self.session, self.phases, self.retained
        cfg = s.config
        rank = plan.rank_of(worker_id())
        if rank is None:
            raise RecoveryError(f"worker {worker_id()} is not in the plan for generation {plan.generation}")
        t1 = time.monotonic()
        gen = Generation(plan.generation, rank, plan.world_size)
        marks = {}
        join(s.store, gen, s.backend, cfg.recovery.collective_timeout_s, cfg.recovery.rendezvous_timeout_s,
             marks=marks)
        s.generation = gen
        if s.events is not None:
            s.events.generation = gen.index
        t_joined = time.monotonic()
        s.check_host_groups(self.records)
        # hotspare's own groups first: the state transfer starts on them and its bytes move while
        # the host's groups are built.
        data_group, control_group = protection.hotspare_groups(s)
        t_own_groups = time.monotonic()
        kept = sources.take_over_retained(s, rank) if retained is None else {}
        holdings = exchange_holdings(control_group, gen.world_size, retained, kept)
        # A spare that took a rank in a generation that failed while it formed is not in this
        # plan's ``replaced``, but it holds no state of its own either.
        new_ranks = sorted({int(r) for r in plan.replaced} | {r for r, h in enumerate(holdings) if not h.own})
        pending = target = lost = None
        try:
            target = choose_version(holdings, new_ranks, stripe_k=cfg.retain.k if cfg.retain.tier2 == "stripe" else 0)
        except NoConsistentVersion as exc:
            lost = exc
        else:
            pending = start_fetch(target, rank, new_ranks, holdings, retained, s.state.layout_for, data_group,
                                  cfg.mirror.timeout_s)
        t_groups = time.monotonic()
        self._repointed = s.rebuild_host_groups(self.records)
        phases["rebuild_s"] = time.monotonic() - t1
        s.events("rebuild", groups=len(self.records), seconds=phases["rebuild_s"],
                 arrive_s=marks["arrived"] - t1, join_s=t_joined - marks["arrived"],
                 own_groups_s=t_own_groups - t_joined, holdings_s=t_groups - t_own_groups,
                 host_groups_s=time.monotonic() - t_groups)

        t2 = time.monotonic()
        if lost is not None:
            version, detail = sources.fall_back(s, lost, control_group)
            phases["fallback"] = detail["checkpoint"]
        else:
            version, detail = sources.restore_from_memory(s, target, pending, retained)
        agreed = [version, s.step_count()]
        if s.same_layout_everywhere:
            agreed.append(Layout.of(s.state.tensors()).id & 0xFFFFFFFF)
        t_agree = time.monotonic()
        agree_on(control_group, agreed)
        phases["restore_s"] = time.monotonic() - t2
        s.events("restore", version=version, seconds=phases["restore_s"], agree_s=time.monotonic() - t_agree,
                 **detail)

        if retained is not None:
            retained.transport.close()
        # The last generation's own snapshot buffers (or, for a spare, the dead rank's retained
        # segment) carry on: taken at the last moment, so that a failure before it leaves them
        # where a retry of this recovery finds them.
        protection.start_mirror(s, data_group, control_group, lambda: (
            retained.hand_over(version) if retained is not None else sources.inherit_kept(s, version)),
            landing=(version, holdings) if lost is None else None)
        sources.drop_kept(s)
        if s.heartbeat is not None:
            s.heartbeat.watch(gen.index, functools.partial(s.alarm.superseded, gen.index))
        if s.mirror is not None and (lost is not None or s.mirror.stripe is not None
                                     or cfg.retain.tier2 == "stripe"):
            # A full mirror's first round never writes over the version before the landing one
            # (Mirror.seed), so a failure during it lands there. A stripe's shares and a
            # checkpoint's landing version are not carried over that way: the landing version
            # reaches the other nodes before training goes on (a spare restored from its node's
            # keeper, or a survivor from its own snapshot, may hold its only copy).
            t3 = time.monotonic()
            protected = s.mirror.settle(cfg.mirror.timeout_s) and s.mirror.error is None
            phases["protect_s"] = time.monotonic() - t3
            if not protected:
                # The round's error (if any) is raised by the next step, which recovers again.
                why = s.mirror.error or f"it did not end within mirror.timeout_s={cfg.mirror.timeout_s} s"
                log(f"rank {rank}: the landing version {version} is not yet on another node: its first round "
                    f"failed ({why})")
                s.events("unprotected", version=version, error=str(why)[:500])
        phases["total_s"] = time.monotonic() - self.t0
        summary = {"generation": gen.index, "version": version, "replaced": plan.replaced,
                   "failures": plan.failures, "kind": report.kind_of(plan.failures), **phases}
        s.recoveries.append(summary)
        if rank == 0 and plan.replaced:
            # A spare taking rank 0 knows no failure step: its first completed step is its mark.
            s.catching_up = CatchUp(gen.index, phases.get("failed_at", -1), version)
        s.events("resume", version=version, **phases)
        s.release_left_groups()
        log(f"rank {rank}: generation {gen.index} resumes at step {version} "
            f"({', '.join(f'{k} {v:.3f}' for k, v in phases.items() if k.endswith('_s'))})")


def agree_on(group, values: list[int]) -> None:
    """Every rank must hold the same ``values`` (landing version, step, layout) before resuming."""
    mine = torch.tensor(values, dtype=torch.int64)
    lo, hi = mine.clone(), -mine
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(lo, -hi):
        raise RecoveryError(f"ranks disagree after the restore on (version, step[, layout]): min {lo.tolist()}, "
                            f"max {(-hi).tolist()}; not resuming on inconsistent state")
