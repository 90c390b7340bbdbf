"""The framework-independent half of a hotspare training session: failover in the training
loop, recovery (plan, rebuild, restore, resume), the mirror and keeper, close. How a process
gets here (an active rank's join, a spare's wait for its order) is :mod:`hotspare.startup`.

:class:`Session` is subclassed per host framework
(:class:`hotspare.integrations.deepspeed.DeepSpeedSession`,
:class:`hotspare.integrations.megatron.MegatronSession`), which say where the step count and
the process-group handles are, how the host's groups are rebuilt in a new generation, and
what the unique state is (``state``: ``tensors``, ``meta``, ``restore``, ``resync``,
``layout_for``, ``load_checkpoint``).
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint, control, env, erasure, rebuild
from .alarm import AlarmGuard
from .config import ConfigError, HotspareConfig
from .events import EventLog, log
from .generation import Generation, Superseded, join, leave
from .keeper import KeeperClient, KeeperError
from .mirror import NO_VERSION, Inherited, Mirror, MirrorError
from .placement import place
from .planning import KEEPER, STRIPE, NoConsistentVersion, choose_version
from .recovery import (RecoveryError, exchange_holdings, is_distributed_error, is_timeout,
                       start_fetch)
from .retain import RetainedSnapshots
from .snapshot import Layout
from .setupguard import SetupGuard
from .sockets import DRAIN_S, abort_nccl, break_connections
from .startup import node_ranks, wait_for_takeover
from .transport import GlooTransport
from .worker import Heartbeat, wait_for_plan, worker_id


@dataclass(kw_only=True)
class Session:
    """A training process's hotspare handles, and its failover (see the subclasses' docs for the
    training-loop API of each framework)."""

    config: HotspareConfig | None
    """The validated ``"hotspare"`` section, or None when the config has none (hotspare off)."""
    generation: Generation
    """The process-group generation this process is in."""
    store: Any
    """The control-store client (None when the process group was set up by the caller)."""
    mirror: Mirror | None = None
    """The peer mirror of this rank's unique state (None when mirroring is off)."""
    state: Any = None
    """What this rank mirrors (the host's unique-state object)."""
    events: EventLog | None = None
    """This rank's event log."""
    groups: tuple = ()
    """Process groups hotspare created (destroyed on close)."""
    heartbeat: Heartbeat | None = None
    """This worker's heartbeat to its launcher (None outside hotspare-run)."""
    recoveries: list = field(default_factory=list)
    """One summary dict per recovery this process took part in (phases and their seconds)."""
    spare: bool = False
    """This process started as a spare and took a failed rank's place."""
    checkpoints: Any = None
    """The background checkpoint engine (None when ``hotspare.checkpoint`` is off)."""
    backend: str = "gloo"
    pin_memory: bool = False
    """Mirror snapshots live in pinned host memory (an accelerator is in use)."""
    same_layout_everywhere: bool = True
    """Every rank's unique state has the same layout (ZeRO's equal partitions), so ranks agree on
    it before resuming; a pipeline's stages differ (each restore checks its own layout)."""
    keeper: KeeperClient | None = None
    """This node's keeper (None when retention is off or the process was not started by hotspare-run)."""
    _kept: Any = None
    """The retained segment of the rank this spare took (read by its restore), and its verified versions."""
    _repointed: list | None = None
    _retired: list = field(default_factory=list)
    """Mirrors of failed generations whose thread may still be inside a transfer (joined at close)."""
    _reapers: list = field(default_factory=list)
    """The threads releasing the groups of generations left behind (:func:`leave`)."""
    _control: Any = field(default=None, repr=False)
    _trained: bool = False
    _setup_guard: SetupGuard | None = None
    """On a spare, from its takeover to its loop's first step: collectives of the script's set-up
    (setupguard.py)."""
    _catching_up: tuple[int, int, int] | None = None
    """Rank 0 after a recovery: (generation, step the failure interrupted, step it landed on) until
    a step of the new generation completes and the count is back at the interrupted step; then
    ``caught_up/<g>`` tells the launchers to start their successor spares (and the coordinator
    that the spares promoted to ``g`` took their ranks)."""

    @property
    def control(self) -> "control.ControlStore | None":
        """The control plane's operations on ``store``, signed with the job's secret (None without
        a store)."""
        if self.store is None:
            return None
        if self._control is None or self._control.raw is not self.store:
            self._control = control.ControlStore(self.store)
        return self._control

    def __post_init__(self) -> None:
        self.alarm = AlarmGuard(self._leave_alarmed)
        self._interrupts = []
        if self.heartbeat is not None:
            # A forward under way raises once the generation failed (see _check_alarm).
            self._interrupts = [m.register_forward_pre_hook(self._check_alarm) for m in self._interruptible()]
        if self.heartbeat is not None and not self.spare:
            self.heartbeat.watch(self.generation.index, functools.partial(self.alarm.superseded, self.generation.index))

    def _interruptible(self) -> list:
        """The modules whose forward checks for the coordinator's alarm: where a step computes
        for a while with no collective that the broken connections would make raise (DeepSpeed
        ZeRO 1/2's forward). None by default."""
        return []

    def _check_alarm(self, module, args) -> None:
        """A forward pre-hook: the step leaves for the recovery once the generation failed."""
        self.alarm.raise_if_alarmed(self.generation.index)

    def _leave_alarmed(self, generation: int) -> None:
        """The coordinator said that ``generation`` failed (its alarm, or the next generation's
        plan) while this worker still trains in it (alarm.py): whatever collective the training
        thread waits in raises now, and the next one at once, instead of at its timeout."""
        log(f"rank {self.generation.rank}: the coordinator says generation {generation} failed; leaving it now")
        if self.backend != "gloo":
            try:  # (a walk of the host's objects: for NCCL's communicators only)
                abort_nccl([r.group for r in self.host_groups()])
            except Exception:  # noqa: BLE001 - best effort from another thread; the sockets are next
                pass
        self._break_connections()

    def _break_connections(self) -> int:
        """Shut down every connection but the control store's (sockets.py); returns how many.
        One still moving a payload when the drain ran out is said: its collective, here and on
        the peer, waits out the group's timeout (gloo wakes neither end)."""
        broken = break_connections({env.env_int(env.HOTSPARE_STORE_PORT, 0)})
        if broken.forced:
            timeout = self.config.recovery.collective_timeout_s if self.config is not None else 0.0
            log(f"rank {self.generation.rank}: {broken.forced} connection(s) still carried a payload after "
                f"{DRAIN_S:g} s and were cut; a collective moving it leaves only at its timeout "
                f"(recovery.collective_timeout_s={timeout:g})")
            self.events("cut_mid_payload", connections=broken.forced)
        return broken.count

    # ---- the training-loop API ---------------------------------------------------------------

    def step_count(self) -> int:
        """Optimizer steps taken (the version the state is at)."""
        raise NotImplementedError

    def steps(self, total: int):
        """Step indices from where the state is (:meth:`step_count`) up to ``total``.

        After a recovery the next index is the landing version's, so the interrupted step and
        any a survivor had run past it are run again, with the same batches.
        """
        self._end_setup()
        while self.step_count() < total:
            yield self.step_count()
            self._note_trained()
            if self._catching_up is not None:
                self._note_caught_up()

    def resilient(self, fn: Callable) -> Callable:
        """Decorate the function that runs one training step (all its micro-batches).

        A failure of a peer inside it (a collective that raises, a broken mirror) is recovered
        in place: a spare takes the failed rank, the state lands on the newest version every
        rank holds, and the call returns None; ``steps`` then resumes from there. An exception
        that is not a distributed failure (a bug) is re-raised at once.
        """
        @functools.wraps(fn)
        def run(*args, **kwargs):
            self._end_setup()
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - classified below
                if not self._can_recover(exc):
                    raise
                self.recover(exc)
                return None
            if self._catching_up is not None:
                self._note_caught_up()
            return result

        return run

    def _note_caught_up(self) -> None:
        """Called after each call of the ``resilient`` function and each step ``steps`` counted:
        a call that completed no step (another function made resilient) does not count."""
        generation, failed_at, landed = self._catching_up
        if self.step_count() <= landed or self.step_count() < failed_at:
            return  # no step completed in this generation yet, or still replaying
        self._catching_up = None
        try:
            self.control.set_caught_up(generation, self.step_count())
        except Exception as exc:  # noqa: BLE001 - the launchers start the successors at their bound
            log(f"rank 0: could not tell the launchers that generation {generation} caught up ({exc}); "
                f"they start the successor spares after --successor-wait-s")

    def _can_recover(self, exc: BaseException) -> bool:
        cfg = self.config
        return (cfg is not None and cfg.enabled and cfg.recovery.enabled and self.store is not None
                and is_distributed_error(exc))

    # ---- recovery ----------------------------------------------------------------------------

    def recover(self, error: BaseException) -> None:
        """A survivor's recovery after ``error``: rebuild in place with the coordinator's plan."""
        cfg = self.config.recovery
        if len(self.recoveries) >= cfg.max_recoveries:
            raise RecoveryError(f"{len(self.recoveries)} recoveries done, recovery.max_recoveries="
                                f"{cfg.max_recoveries}: stopping (a failure that keeps recurring is not transient)") \
                from error
        t0 = time.monotonic()
        if self.heartbeat is not None:
            self.heartbeat.watch(None)
        self.alarm.begin_leaving(self.generation.index)
        failed_at = self.step_count()
        # The coordinator first: once every survivor has said so, it plans without waiting out
        # its settle window (the walk for the host's groups comes after).
        self._report_waiting(self.generation.index, error)
        early = 0
        if self.backend == "gloo":
            # Then the peers blocked on this rank in a collective learn of it at once (with NCCL
            # its communicators are aborted first, in _break_off, which needs the walk).
            early = self._break_connections()
        self.events("failure_seen", version=failed_at, error=str(error)[:500],
                    error_type=type(error).__name__, timed_out=is_timeout(error))
        log(f"rank {self.generation.rank}: failure seen at step {failed_at}: "
             f"{type(error).__name__}: {str(error)[:200]}")
        retained = self.mirror  # frozen by _break_off; the restore reads what it holds
        records = self.host_groups()
        broken = early + self._break_off(records, self.generation.index, error, reported=True,
                                         already_broken=self.backend == "gloo")
        if self.checkpoints is not None and not self.checkpoints.flush(cfg.rendezvous_timeout_s):
            log(f"rank {self.generation.rank}: the checkpoint writer is still busy after "
                 f"{cfg.rendezvous_timeout_s} s; recovering without waiting for it")
        self.events("left", connections_broken=broken, seconds=time.monotonic() - t0)
        self._land(None, self.generation.index + 1, records, retained, {"failed_at": failed_at}, t0, error)

    def _land(self, plan, generation: int, records, retained: Mirror | None, phases: dict, t0: float,
              error: BaseException | None = None) -> None:
        """Take part in ``plan`` (or wait for the plan of ``generation``). When a member fails while
        the new generation forms, leave it and go on with the coordinator's next plan."""
        cfg = self.config.recovery
        while True:
            if plan is None:
                plan = wait_for_plan(self.control, generation, cfg.rendezvous_timeout_s)
                phases.setdefault("plan_s", time.monotonic() - t0)
                self.events("plan", generation=plan.generation, replaced=plan.replaced, failures=plan.failures,
                            wait_s=time.monotonic() - t0)
                if plan.abort:
                    raise RecoveryError(f"the job cannot recover: {plan.abort}") from error
            self._repointed = None
            try:
                self._take_part(plan, records, retained, phases, t0)
                return
            except Superseded as exc:
                # Said like any other way out of a generation: the coordinator kills a member of a
                # failed generation that did not say it left (one stuck in it).
                self._report_waiting(plan.generation, exc)
                generation = exc.generation
            except Exception as exc:  # noqa: BLE001 - classified here
                if not is_distributed_error(exc) or not dist.is_initialized():
                    raise  # a bug, or a member that never arrived (the error names it)
                generation = plan.generation + 1
                # The engine points at this attempt's groups once they were re-pointed.
                records = self._repointed or records
                self._break_off(records, plan.generation, exc)
            self.events("retry", generation=generation, failed_generation=plan.generation)
            log(f"rank {self.generation.rank}: generation {plan.generation} failed while it formed; "
                 f"joining generation {generation}")
            plan = None

    def _break_off(self, records, generation: int, error: BaseException, reported: bool = False,
                   already_broken: bool = False) -> int:
        """Leave ``generation`` at once (a failure in it, or while it formed): tell the coordinator
        (unless ``reported``), abort NCCL, shut down every connection but the store's (unless
        ``already_broken``: a second pass over the descriptors finds none and costs 1-2 ms),
        so that no survivor waits out a collective timeout, freeze the mirror, destroy the
        groups. Returns the connections broken here."""
        if not reported:
            self._report_waiting(generation, error)
        if dist.is_initialized():
            abort_nccl([r.group for r in records])
        broken = 0 if already_broken else self._break_connections()
        if self.mirror is not None:
            self.mirror.stop()
            self._retired.append(self.mirror)
            self.mirror = None
        self.groups = ()
        self._reap(leave(background=True))
        return broken

    def _reap(self, reaper) -> None:
        """Keep a left generation's groups until the recovery is over (:meth:`_release_left_groups`)."""
        if reaper is not None:
            self._reapers.append(reaper)

    def _release_left_groups(self) -> None:
        """Training resumes: the groups of the generations left behind are destroyed meanwhile."""
        self._reapers = [r for r in self._reapers if r.ident is None or r.is_alive()]
        for reaper in self._reapers:
            if reaper.ident is None:
                reaper.start()

    def _drop_kept(self) -> None:
        if self._kept is not None:
            self._kept.segment.close()
            self._kept = None

    def _report_waiting(self, generation: int, error: BaseException) -> None:
        # Tell the coordinator at once: a failure no launcher saw (a peer stuck while it keeps
        # beating) is found from which workers do not say this.
        timed_out = is_timeout(error)
        self.control.report_waiting(control.Waiting(
            worker=worker_id(), rank=self.generation.rank, generation=generation, timed_out=timed_out,
            waited_s=self.config.recovery.collective_timeout_s if timed_out else 0.0,
            rendezvous_timeout_s=self.config.recovery.rendezvous_timeout_s))

    def _take_part(self, plan, records, retained: Mirror | None, phases: dict, t0: float) -> None:
        """Join ``plan``'s generation, rebuild every group, restore, restart mirroring (survivor or spare)."""
        cfg = self.config
        rank = plan.rank_of(worker_id())
        if rank is None:
            raise RecoveryError(f"worker {worker_id()} is not in the plan for generation {plan.generation}")
        t1 = time.monotonic()
        gen = Generation(plan.generation, rank, plan.world_size)
        marks = {}
        join(self.store, gen, self.backend, cfg.recovery.collective_timeout_s, cfg.recovery.rendezvous_timeout_s,
             marks=marks)
        self.generation = gen
        if self.events is not None:
            self.events.generation = gen.index
        t_joined = time.monotonic()
        self._check_host_groups(records)
        # hotspare's own groups first: the state transfer starts on them and its bytes move while
        # DeepSpeed's groups are built.
        data_group, control_group = self._hotspare_groups()
        t_own_groups = time.monotonic()
        kept = self._take_over_retained(rank) if retained is None else {}
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
            pending = start_fetch(target, rank, new_ranks, holdings, retained, self.state.layout_for, data_group,
                                  cfg.mirror.timeout_s)
        t_groups = time.monotonic()
        self._repointed = self._rebuild_host_groups(records)
        phases["rebuild_s"] = time.monotonic() - t1
        self.events("rebuild", groups=len(records), seconds=phases["rebuild_s"],
                    arrive_s=marks["arrived"] - t1, join_s=t_joined - marks["arrived"],
                    own_groups_s=t_own_groups - t_joined, holdings_s=t_groups - t_own_groups,
                    host_groups_s=time.monotonic() - t_groups)

        t2 = time.monotonic()
        if lost is not None:
            version, detail = self._fall_back(lost, control_group)
            phases["fallback"] = detail["checkpoint"]
        else:
            version, detail = self._restore_from_memory(target, pending, retained)
        agreed = [version, self.step_count()]
        if self.same_layout_everywhere:
            agreed.append(Layout.of(self.state.tensors()).id & 0xFFFFFFFF)
        t_agree = time.monotonic()
        agree_on(control_group, agreed)
        phases["restore_s"] = time.monotonic() - t2
        self.events("restore", version=version, seconds=phases["restore_s"], agree_s=time.monotonic() - t_agree,
                    **detail)

        if retained is not None:
            retained.transport.close()
        # The last generation's own snapshot buffers (or, for a spare, the dead rank's retained
        # segment) carry on: taken at the last moment, so that a failure before it leaves them
        # where a retry of this recovery finds them.
        self._start_mirror(data_group, control_group, lambda: (
            retained.hand_over(version) if retained is not None else self._inherit_kept(version)),
            landing=(version, holdings) if lost is None else None)
        self._drop_kept()
        if self.heartbeat is not None:
            self.heartbeat.watch(gen.index, functools.partial(self.alarm.superseded, gen.index))
        if self.mirror is not None and (lost is not None or self.mirror.stripe is not None
                                        or cfg.retain.tier2 == "stripe"):
            # A full mirror's first round never writes over the version before the landing one
            # (Mirror.seed), so a failure during it lands there. A stripe's shares and a
            # checkpoint's landing version are not carried over that way: the landing version
            # reaches the other nodes before training goes on (a spare restored from its node's
            # keeper, or a survivor from its own snapshot, may hold its only copy).
            t3 = time.monotonic()
            protected = self.mirror.settle(cfg.mirror.timeout_s) and self.mirror.error is None
            phases["protect_s"] = time.monotonic() - t3
            if not protected:
                # The round's error (if any) is raised by the next step, which recovers again.
                why = self.mirror.error or f"it did not end within mirror.timeout_s={cfg.mirror.timeout_s} s"
                log(f"rank {rank}: the landing version {version} is not yet on another node: its first round "
                    f"failed ({why})")
                self.events("unprotected", version=version, error=str(why)[:500])
        phases["total_s"] = time.monotonic() - t0
        summary = {"generation": gen.index, "version": version, "replaced": plan.replaced,
                   "failures": plan.failures, **phases}
        self.recoveries.append(summary)
        if rank == 0 and plan.replaced:
            # A spare taking rank 0 knows no failure step: its first completed step is its mark.
            self._catching_up = (gen.index, phases.get("failed_at", -1), version)
        self.events("resume", version=version, **phases)
        self._release_left_groups()
        log(f"rank {rank}: generation {gen.index} resumes at step {version} "
             f"({', '.join(f'{k} {v:.3f}' for k, v in phases.items() if k.endswith('_s'))})")

    def _take_over_retained(self, rank: int) -> dict[int, int]:
        """A spare: what this node's keeper retained of ``rank``, checked chunk by chunk
        ({version: slot}; empty when nothing usable, e.g. the rank died on another node)."""
        self._drop_kept()
        if self.keeper is None:
            return {}
        try:
            kept, detail = self.keeper.take_over(rank, self.state.layout_for)
        except KeeperError as exc:
            log(f"rank {rank}: {exc}; restoring from peers")
            return {}
        self.events("keeper_attach", **detail)
        if detail.get("corrupt_chunks"):
            log(f"rank {rank}: the keeper's copy of version(s) {', '.join(detail['corrupt_chunks'])} fails its "
                 f"checksum (chunks {detail['corrupt_chunks']}); it is not used")
        if detail.get("device", {}).get("why"):
            log(f"rank {rank}: the keeper's device copy (version {detail['device']['version']}) is not used: "
                f"{detail['device']['why']}")
        self._kept = kept
        return kept.good if kept is not None else {}

    def _inherit_kept(self, version: int) -> Inherited | None:
        """A spare: the dead rank's retained segment becomes its own snapshots (the keeper would
        hand it the same one), still holding each verified version up to ``version`` (the one
        landed on: the state was restored from it, or from a peer's copy of it)."""
        if self._kept is None:
            return None
        kept, self._kept = self._kept, None
        segment, good = kept.segment, kept.good
        layout = self.state.layout_for(segment.layout_id)
        snapshots = RetainedSnapshots(segment, layout, self.pin_memory, kept.device)
        by_slot = {slot: v for v, slot in good.items() if v <= version}
        versions = [by_slot.get(slot, NO_VERSION) for slot in range(len(snapshots.buffers))]
        for slot, v in enumerate(versions):
            if v == NO_VERSION:
                snapshots.begin(slot)
        return Inherited(layout, snapshots, versions)

    def _restore_from_memory(self, target, pending, retained) -> tuple[int, dict]:
        """Land on ``target``: this rank's own snapshot, its node keeper's copy, or its bytes from the
        holders of its mirror (``pending``: the transfer started before the host's groups were built)."""
        rank = self.generation.rank
        received, moved = pending.wait()
        first = target.sources[rank][0]
        on_device = None
        if first == KEEPER:
            kept = self._kept
            buf, layout, source = (kept.segment.slots[kept.good[target.version]],
                                   self.state.layout_for(kept.segment.layout_id), "keeper")
            if kept.device_version == target.version:
                # The tensors from the keeper's device copy (device to device); the metadata and
                # RNG states from the host slot of the same version.
                on_device, source = kept.device, "keeper_device"
        elif received is not None:
            (buf, layout), source = received, "stripe" if first == STRIPE else "peers"
        else:
            buf = retained.own_snapshot(target.version) if retained is not None else None
            layout, source = (retained.layout if retained is not None else None), "self"
            if buf is None:
                raise RecoveryError(f"rank {rank} has no snapshot of version {target.version} to restore")
        t0 = time.monotonic()
        self.state.restore(buf, layout, tensors_from=on_device)
        t1 = time.monotonic()
        self.state.resync()
        return target.version, {"source": source, **moved, "load_s": t1 - t0, "resync_s": time.monotonic() - t1}

    def _fall_back(self, lost: NoConsistentVersion, control_group) -> tuple[int, dict]:
        """Every in-memory copy of some rank is gone: load the newest complete persistent checkpoint
        (every rank the same one), or stop every rank saying what was lost."""
        ck, world = self.config.checkpoint, self.generation.world_size
        steps = checkpoint.complete_steps(ck.dir, world) if ck.enabled else []
        # Every writer drained before the scan (recover flushes), so all ranks see the same
        # directory; the minimum guards against one that did not.
        newest = torch.tensor([steps[-1] if steps else -1], dtype=torch.int64)
        dist.all_reduce(newest, op=dist.ReduceOp.MIN, group=control_group)
        step = int(newest)
        if step < 0:
            where = (f"no complete checkpoint exists under {ck.dir}" if ck.enabled else
                     "no persistent checkpoint is configured (hotspare.checkpoint)")
            self.events("fallback", reason=str(lost), checkpoint=None)
            message = (f"{lost}. {where.capitalize()} to fall back on; every rank stops. Add mirror replicas "
                       f"(hotspare.mirror.replicas) or persistent checkpoints (hotspare.checkpoint.every) to "
                       f"survive this failure.")
            self.control.abort(message)  # every launcher stops its workers: no cascade of spares
            raise RecoveryError(message) from None
        path = os.path.join(ck.dir, checkpoint.tag_of(step))
        self.events("fallback", version=step, reason=str(lost), checkpoint=path)
        log(f"rank {self.generation.rank}: {lost}; falling back on the persistent checkpoint {path}: the steps "
             f"since step {step} are run again")
        self.state.load_checkpoint(ck.dir, checkpoint.tag_of(step))
        return step, {"source": "checkpoint", "checkpoint": path}

    def _join_as_spare(self, plan, rank: int, t_order: float) -> None:
        """A spare whose host objects are built for ``rank`` (on torch's fake group): wait for the
        order if it has not come yet, join the survivors' generation and land with them."""
        records = self.host_groups()
        self._reap(leave(background=True))  # the fake group
        t_built = time.monotonic()
        if plan is None:
            plan = wait_for_takeover(self.control, self.heartbeat)
            if plan.rank_of(worker_id()) != rank:
                raise RecoveryError(f"spare {worker_id()} built rank {rank}'s state as told, but the plan for "
                                    f"generation {plan.generation} gives it rank {plan.rank_of(worker_id())}")
        self.events("takeover", generation=plan.generation, replaced=plan.replaced)
        self._land(plan, plan.generation, records, None, {"engine_build_s": t_built - t_order}, t_order)
        if self.store is not None:
            plane, wid = self.control, worker_id()
            self._setup_guard = SetupGuard(lambda message: plane.set_unfit(wid, message)).start()

    def _note_trained(self) -> None:
        """Rank 0, once: the job's first step completed (the coordinator tells a script that fails
        before it from a fault spares can cover)."""
        if not self._trained and self.store is not None and self.generation.rank == 0:
            self.control.mark_trained()
        self._trained = True

    def _end_setup(self) -> None:
        """The loop's first step: a spare's set-up guard (setupguard.py) is lifted."""
        if self._setup_guard is not None:
            self._setup_guard.stop()
            self._setup_guard = None

    # ---- what each host framework says -----------------------------------------------------

    def roots(self) -> list:
        """Where the host keeps process-group handles (walked by :mod:`hotspare.rebuild`)."""
        raise NotImplementedError

    def host_groups(self) -> list:
        """The host's process groups (records taken before the old generation's are destroyed)."""
        return rebuild.find_groups(self.roots())

    def _check_host_groups(self, records) -> None:
        """Before any group of the new generation is made: every rank must rebuild the same ones."""
        rebuild.check_signature(records, self.generation.world_size)

    def _rebuild_host_groups(self, records) -> list:
        """The host's groups anew in the current generation, every handle re-pointed; returns the
        records of the new groups (the host holds them from here on)."""
        mapping = rebuild.create_groups(records, self.config.recovery.collective_timeout_s, backend=self.backend)
        rebuild.repoint_records(records, mapping)
        return [dataclasses.replace(r, group=mapping[id(r.group)]) for r in records]

    def _stages(self, group) -> list[int] | None:
        """Every rank's pipeline stage (collective over ``group``), or None without pipelines."""
        return None

    def _hotspare_groups(self) -> tuple:
        """The mirror's data and control groups for the current generation (gloo, host memory)."""
        timeout = datetime.timedelta(seconds=self.config.mirror.timeout_s)
        # Mirror bytes and the per-step agreement get groups of their own, so they never queue
        # behind the training collectives.
        data_group = dist.new_group(backend="gloo", timeout=timeout)
        control_group = dist.new_group(backend="gloo", timeout=timeout)
        self.groups = (data_group, control_group)
        return data_group, control_group

    def _start_mirror(self, data_group, control_group, inherit: Callable[[], Inherited | None] = lambda: None,
                      landing: tuple[int, list] | None = None) -> None:
        """Start mirroring in the current generation and seed it with the state as it is now
        (``inherit()``: the last generation's own snapshot buffers, reused: no allocation;
        ``landing``: (version, every rank's holdings) after a restore from memory: the first
        round moves that version only where it is not held yet)."""
        cfg, gen = self.config, self.generation
        mc = cfg.mirror
        if not (mc.enabled and (mc.replicas > 0 or self.keeper is not None or cfg.retain.tier2 == "stripe")
                and gen.world_size > 1):
            return
        nodes = node_ranks(control_group)
        rc = cfg.retain
        stripe = (rc.k, rc.m) if rc.tier2 == "stripe" else None
        try:
            if stripe is not None:
                try:
                    rc.check_nodes(len(set(nodes)))
                    holders = erasure.place_shares(nodes, rc.k, rc.m)
                except ValueError as exc:
                    if gen.index == 0:
                        raise
                    # A spare of another node took a lost node's rank: the job has fewer nodes
                    # than the stripe needs. Protect with full copies until it ends (better than
                    # stopping a job that can go on).
                    log(f"rank {gen.rank}: generation {gen.index} cannot stripe ({exc}); tier 2 falls back to "
                         f"mirror copies (mirror.replicas={max(1, mc.replicas)}) for the rest of the job")
                    self.events("tier2_degraded", reason=str(exc), nodes=nodes)
                    stripe = None
                    holders = place(nodes, max(1, mc.replicas))
            else:
                holders = place(nodes, mc.replicas, stage_of_rank=self._stages(control_group))
        except ValueError as exc:
            key = "retain.k/m" if stripe is not None else f"mirror.replicas={mc.replicas}"
            raise ConfigError(f"hotspare.{key}: {exc}") from None
        snapshots = None
        if self.keeper is not None:
            def note(text: str) -> None:
                log(f"rank {gen.rank}: {text}")
                self.events("retain_budget", note=text)

            snapshots = self.keeper.snapshots_for(gen.rank, mc.chunk_bytes, cfg.retain.budget_bytes, note,
                                                   self.pin_memory, self.keeper.device_index())

        def agree(t: torch.Tensor) -> None:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group)

        self.mirror = Mirror(gen.rank, gen.index, holders, GlooTransport(data_group, gen.rank), agree,
                             in_flight=mc.in_flight, chunk_bytes=mc.chunk_bytes, timeout_s=mc.timeout_s,
                             pin_memory=self.pin_memory, on_event=self.events, snapshots=snapshots, stripe=stripe,
                             inherit=inherit())
        self.events("mirror_start", holders=holders[gen.rank], nodes=nodes, single_node=len(set(nodes)) == 1)
        # The state as it is now is a version too: a failure in the very next step lands here.
        held_by, held_from = [], []
        if landing is not None and stripe is None:
            version, holdings = landing
            me = gen.rank
            held_by = [h for h in holders.get(me, []) if version in holdings[h].held.get(me, ())]
            held_from = [s for s, hs in holders.items() if me in hs and version in holdings[me].held.get(s, ())]
        self.mirror.seed(self.step_count(), self.state.tensors, self.state.meta, reuse=landing is not None,
                         held_by=held_by, held_from=held_from)

    def close(self) -> None:
        """Stop mirroring, write the queued checkpoints, leave the current generation; call once at
        the end of training."""
        self._end_setup()
        if self.mirror is not None:
            try:  # the last round, so that no peer's round fails on a transport closed under it
                self.mirror.flush(self.config.mirror.timeout_s)
            except MirrorError:
                pass  # a peer is gone already: nothing left to mirror to
            self.mirror.close()
            self.mirror = None
        if self.checkpoints is not None:
            self.checkpoints.close()
            self.checkpoints = None
        self._drop_kept()
        for old in self._retired:
            if not old.join():
                log(f"rank {self.generation.rank}: a mirror thread of generation {old.generation} is still blocked "
                     f"in a transfer after {old.timeout_s + 5} s")
        self._retired = []
        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None
        for hook in self._interrupts:
            hook.remove()
        self._interrupts = []
        if self.events is not None:
            self.events.close()
        for group in self.groups:
            dist.destroy_process_group(group)
        self.groups = ()
        leave()
        for reaper in self._reapers:
            reaper.finish()
        self._reapers = []
        self.store = None


def agree_on(group, values: list[int]) -> None:
    """Every rank must hold the same ``values`` (landing version, step, layout) before resuming."""
    mine = torch.tensor(values, dtype=torch.int64)
    lo, hi = mine.clone(), -mine
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(lo, -hi):
        raise RecoveryError(f"ranks disagree after the restore on (version, step[, layout]): min {lo.tolist()}, "
                            f"max {(-hi).tolist()}; not resuming on inconsistent state")
