"""DeepSpeed integration: start-up through hotspare, and access to ZeRO's partitions.

Internals read here (pinned by tests/test_deepspeed_internals.py, which fail loudly on a
DeepSpeed upgrade that moves them):
- ZeRO 1/2 ``DeepSpeedZeroOptimizer.single_partition_of_fp32_groups[i]``: the flat fp32
  master partition of param group i; the inner optimizer's only parameter of that group.
- ZeRO 3 ``DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat[j]``: the flat fp32
  partition of sub-group j; the inner optimizer's parameters.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import checkpoint, control, env, erasure, rebuild
from ..config import ConfigError, HotspareConfig, split_deepspeed_config
from ..events import EventLog
from ..generation import Generation, Superseded, join, leave, store_from_env
from ..keeper import KeeperClient, KeeperError
from ..mirror import NO_VERSION, Inherited, Mirror, MirrorError
from ..placement import place
from ..planning import KEEPER, STRIPE, NoConsistentVersion, choose_version
from ..recovery import RecoveryError, exchange_holdings, is_distributed_error, is_timeout, start_fetch
from ..retain import RetainedSnapshots
from ..snapshot import Layout, read_meta
from ..sockets import abort_nccl, break_connections
from ..transport import GlooTransport
from ..worker import Heartbeat, Shutdown, role, wait_for_order, wait_for_plan, worker_id

SUPPORTED_DEEPSPEED = ("0.19.",)


def check_version() -> str:
    import deepspeed

    if not deepspeed.__version__.startswith(SUPPORTED_DEEPSPEED):
        raise RuntimeError(
            f"hotspare supports DeepSpeed {', '.join(v + 'x' for v in SUPPORTED_DEEPSPEED)}, found "
            f"{deepspeed.__version__}; install a supported version (requirements.txt pins one)")
    return deepspeed.__version__


@dataclass
class Session:
    """What ``hotspare.initialize`` returns: the DeepSpeed objects plus hotspare's handles.

    The training loop gains failover with two lines (see :meth:`resilient` and :meth:`steps`)::

        @session.resilient
        def train_step(step):
            loss = engine(batch(step)); engine.backward(loss); engine.step()
            return loss

        for step in session.steps(total_steps):
            train_step(step)
    """

    engine: Any
    """The ``DeepSpeedEngine``."""
    optimizer: Any
    """The (ZeRO-wrapped) optimizer, as ``deepspeed.initialize`` returns it."""
    training_dataloader: Any
    """DeepSpeed's dataloader, when ``training_data`` was passed."""
    lr_scheduler: Any
    """The LR scheduler, when one was configured."""
    config: HotspareConfig | None
    """The validated ``"hotspare"`` section, or None when the config has none (hotspare off)."""
    generation: Generation
    """The process-group generation this process is in."""
    store: Any
    """The control-store client (None when the process group was set up by the caller)."""
    mirror: Mirror | None = None
    """The peer mirror of this rank's unique state (None when mirroring is off)."""
    state: "DeepSpeedState | None" = None
    """What this rank mirrors."""
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
    keeper: KeeperClient | None = None
    """This node's keeper (None when retention is off or the process was not started by hotspare-run)."""
    _kept: Any = None
    """The retained segment of the rank this spare took (read by its restore), and its verified versions."""
    _repointed: list | None = None
    _retired: list = field(default_factory=list)
    """Mirrors of failed generations whose thread may still be inside a transfer (joined at close)."""

    # ---- the training-loop API ---------------------------------------------------------------

    def steps(self, total: int):
        """Step indices from where the state is (``engine.global_steps``) up to ``total``.

        After a recovery the next index is the landing version's, so the interrupted step and
        any a survivor had run past it are run again, with the same batches.
        """
        while self.engine.global_steps < total:
            yield self.engine.global_steps

    def resilient(self, fn: Callable) -> Callable:
        """Decorate the function that runs one training step (all its micro-batches).

        A failure of a peer inside it (a collective that raises, a broken mirror) is recovered
        in place: a spare takes the failed rank, the state lands on the newest version every
        rank holds, and the call returns None; ``steps`` then resumes from there. An exception
        that is not a distributed failure (a bug) is re-raised at once.
        """
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - classified below
                if not self._can_recover(exc):
                    raise
                self.recover(exc)
                return None

        return run

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
        failed_at = self.engine.global_steps
        self.events("failure_seen", version=failed_at, error=str(error)[:500],
                    error_type=type(error).__name__, timed_out=is_timeout(error))
        _log(f"rank {self.generation.rank}: failure seen at step {self.engine.global_steps}: "
             f"{type(error).__name__}: {str(error)[:200]}")
        retained = self.mirror  # frozen by _break_off; the restore reads what it holds
        records = rebuild.find_groups(self.roots())
        broken = self._break_off(records, self.generation.index, error)
        if self.checkpoints is not None and not self.checkpoints.flush(cfg.rendezvous_timeout_s):
            _log(f"rank {self.generation.rank}: the checkpoint writer is still busy after "
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
                plan = wait_for_plan(self.store, generation, cfg.rendezvous_timeout_s)
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
                generation = exc.generation
            except Exception as exc:  # noqa: BLE001 - classified here
                if not is_distributed_error(exc) or not dist.is_initialized():
                    raise  # a bug, or a member that never arrived (the error names it)
                generation = plan.generation + 1
                # The engine points at this attempt's groups once they were re-pointed.
                records = self._repointed or records
                self._break_off(records, plan.generation, exc)
            self.events("retry", generation=generation, failed_generation=plan.generation)
            _log(f"rank {self.generation.rank}: generation {plan.generation} failed while it formed; "
                 f"joining generation {generation}")
            plan = None

    def _break_off(self, records, generation: int, error: BaseException) -> int:
        """Leave ``generation`` at once (a failure in it, or while it formed): tell the coordinator,
        abort NCCL, shut down every connection but the store's (so no survivor waits out a
        collective timeout), freeze the mirror, destroy the groups. Returns the connections broken."""
        # The coordinator first: once every survivor has said so, it plans without waiting out
        # its settle window.
        self._report_waiting(generation, error)
        if dist.is_initialized():
            abort_nccl([r.group for r in records])
        broken = break_connections({env.env_int(env.HOTSPARE_STORE_PORT, 0)})
        if self.mirror is not None:
            self.mirror.stop()
            self._retired.append(self.mirror)
            self.mirror = None
        self.groups = ()
        leave()
        return broken

    def _drop_kept(self) -> None:
        if self._kept is not None:
            self._kept[0].close()
            self._kept = None

    def _report_waiting(self, generation: int, error: BaseException) -> None:
        # Tell the coordinator at once: a failure no launcher saw (a peer stuck while it keeps
        # beating) is found from which workers do not say this.
        timed_out = is_timeout(error)
        control.append(self.store, control.WAIT_COUNT, "wait/", json.dumps(dataclasses.asdict(control.Waiting(
            worker=worker_id(), rank=self.generation.rank, generation=generation, timed_out=timed_out,
            waited_s=self.config.recovery.collective_timeout_s if timed_out else 0.0))))

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
        rebuild.check_signature(records, gen.world_size)
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
        mapping = rebuild.create_groups(records, cfg.recovery.collective_timeout_s, backend=self.backend)
        rebuild.repoint(self.roots(), mapping)
        self._repointed = [dataclasses.replace(r, group=mapping[id(r.group)]) for r in records]
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
        layout = Layout.of(self.state.tensors())
        _agree_on(control_group, [version, self.engine.global_steps, layout.id & 0xFFFFFFFF])
        phases["restore_s"] = time.monotonic() - t2
        self.events("restore", version=version, seconds=phases["restore_s"], **detail)

        if retained is not None:
            retained.transport.close()
        # The last generation's own snapshot buffers (or, for a spare, the dead rank's retained
        # segment) carry on: taken at the last moment, so that a failure before it leaves them
        # where a retry of this recovery finds them.
        self._start_mirror(data_group, control_group, lambda: (
            retained.hand_over(version) if retained is not None else self._inherit_kept(version)))
        self._drop_kept()
        phases["total_s"] = time.monotonic() - t0
        summary = {"generation": gen.index, "version": version, "replaced": plan.replaced,
                   "failures": plan.failures, **phases}
        self.recoveries.append(summary)
        self.events("resume", version=version, **phases)
        _log(f"rank {rank}: generation {gen.index} resumes at step {version} "
             f"({', '.join(f'{k} {v:.3f}' for k, v in phases.items() if k.endswith('_s'))})")

    def _take_over_retained(self, rank: int) -> dict[int, int]:
        """A spare: what this node's keeper retained of ``rank``, checked chunk by chunk
        ({version: slot}; empty when nothing usable, e.g. the rank died on another node)."""
        self._drop_kept()
        if self.keeper is None:
            return {}
        try:
            segment, good, detail = self.keeper.take_over(rank, self.state.layout_for)
        except KeeperError as exc:
            _log(f"rank {rank}: {exc}; restoring from peers")
            return {}
        self.events("keeper_attach", **detail)
        if detail.get("corrupt_chunks"):
            _log(f"rank {rank}: the keeper's copy of version(s) {', '.join(detail['corrupt_chunks'])} fails its "
                 f"checksum (chunks {detail['corrupt_chunks']}); it is not used")
        if segment is not None:
            self._kept = (segment, good)
        return good

    def _inherit_kept(self, version: int) -> Inherited | None:
        """A spare: the dead rank's retained segment becomes its own snapshots (the keeper would
        hand it the same one), still holding ``version`` when that is what was restored from it."""
        if self._kept is None:
            return None
        segment, good = self._kept
        self._kept = None
        layout = self.state.layout_for(segment.layout_id)
        snapshots = RetainedSnapshots(segment, layout)
        versions = [version if good.get(version) == slot else NO_VERSION for slot in range(len(snapshots.buffers))]
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
        if first == KEEPER:
            segment, good = self._kept
            buf, layout, source = segment.slots[good[target.version]], self.state.layout_for(segment.layout_id), "keeper"
        elif received is not None:
            (buf, layout), source = received, "stripe" if first == STRIPE else "peers"
        else:
            buf = retained.own_snapshot(target.version) if retained is not None else None
            layout, source = (retained.layout if retained is not None else None), "self"
            if buf is None:
                raise RecoveryError(f"rank {rank} has no snapshot of version {target.version} to restore")
        self.state.restore(buf, layout)
        self.state.resync()
        return target.version, {"source": source, **moved}

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
            self.store.set(control.ABORT, message)  # every launcher stops its workers: no cascade of spares
            raise RecoveryError(message) from None
        path = os.path.join(ck.dir, checkpoint.tag_of(step))
        self.events("fallback", version=step, reason=str(lost), checkpoint=path)
        _log(f"rank {self.generation.rank}: {lost}; falling back on the persistent checkpoint {path}: the steps "
             f"since step {step} are run again")
        self.state.load_checkpoint(ck.dir, checkpoint.tag_of(step))
        return step, {"source": "checkpoint", "checkpoint": path}

    def save_checkpoint(self) -> None:
        """Save a persistent DeepSpeed checkpoint of the current step (collective: every rank).

        The files are DeepSpeed's own; hotspare adds the RNG states and data position as client
        state, and the writes happen on the background writer thread.
        """
        ck, e = self.config.checkpoint, self.engine
        t0 = time.monotonic()
        e.save_checkpoint(ck.dir, tag=checkpoint.tag_of(e.global_steps), save_latest=False,
                          client_state={"hotspare": self.state.extras()})
        self.events("checkpoint_start", version=e.global_steps, seconds=time.monotonic() - t0,
                    wait_s=self.checkpoints.last_wait_s)

    def roots(self) -> list:
        """Where DeepSpeed keeps process-group handles (walked by :mod:`hotspare.rebuild`)."""
        import deepspeed.comm.comm
        import deepspeed.utils.groups

        return [self.engine, deepspeed.utils.groups, deepspeed.comm.comm]

    def _hotspare_groups(self) -> tuple:
        """The mirror's data and control groups for the current generation (gloo, host memory)."""
        timeout = datetime.timedelta(seconds=self.config.mirror.timeout_s)
        # Mirror bytes and the per-step agreement get groups of their own, so they never queue
        # behind the training collectives.
        data_group = dist.new_group(backend="gloo", timeout=timeout)
        control_group = dist.new_group(backend="gloo", timeout=timeout)
        self.groups = (data_group, control_group)
        return data_group, control_group

    def _start_mirror(self, data_group, control_group,
                      inherit: Callable[[], Inherited | None] = lambda: None) -> None:
        """Start mirroring in the current generation and seed it with the state as it is now
        (``inherit()``: the last generation's own snapshot buffers, reused: no allocation)."""
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
                    _log(f"rank {gen.rank}: generation {gen.index} cannot stripe ({exc}); tier 2 falls back to "
                         f"mirror copies (mirror.replicas={max(1, mc.replicas)}) for the rest of the job")
                    self.events("tier2_degraded", reason=str(exc), nodes=nodes)
                    stripe = None
                    holders = place(nodes, max(1, mc.replicas))
            else:
                holders = place(nodes, mc.replicas)
        except ValueError as exc:
            key = "retain.k/m" if stripe is not None else f"mirror.replicas={mc.replicas}"
            raise ConfigError(f"hotspare.{key}: {exc}") from None
        snapshots = None
        if self.keeper is not None:
            def note(text: str) -> None:
                _log(f"rank {gen.rank}: {text}")
                self.events("retain_budget", note=text)

            snapshots = self.keeper.snapshots_for(gen.rank, mc.chunk_bytes, cfg.retain.budget_bytes, note)

        def agree(t: torch.Tensor) -> None:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group)

        from deepspeed.accelerator import get_accelerator

        pin = get_accelerator().device_name() != "cpu"
        self.mirror = Mirror(gen.rank, gen.index, holders, GlooTransport(data_group, gen.rank), agree,
                             in_flight=mc.in_flight, chunk_bytes=mc.chunk_bytes, timeout_s=mc.timeout_s,
                             pin_memory=pin, on_event=self.events, snapshots=snapshots, stripe=stripe,
                             inherit=inherit())
        self.events("mirror_start", holders=holders[gen.rank], nodes=nodes, single_node=len(set(nodes)) == 1)
        # The state as it is now is a version too: a failure in the very next step lands here.
        self.mirror.on_step(self.engine.global_steps, self.state.tensors, self.state.meta)

    def close(self) -> None:
        """Stop mirroring, write the queued checkpoints, leave the current generation; call once at
        the end of training."""
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
                _log(f"rank {self.generation.rank}: a mirror thread of generation {old.generation} is still blocked "
                     f"in a transfer after {old.timeout_s + 5} s")
        self._retired = []
        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None
        if self.events is not None:
            self.events.close()
        for group in self.groups:
            dist.destroy_process_group(group)
        self.groups = ()
        leave()
        self.store = None


def _log(msg: str) -> None:
    print(f"[hotspare] {msg}", file=sys.stderr, flush=True)


def _agree_on(group, values: list[int]) -> None:
    """Every rank must hold the same ``values`` (landing version, step, layout) before resuming."""
    mine = torch.tensor(values, dtype=torch.int64)
    lo, hi = mine.clone(), -mine
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(lo, -hi):
        raise RecoveryError(f"ranks disagree after the restore on (version, step, layout): min {lo.tolist()}, "
                            f"max {(-hi).tolist()}; not resuming on inconsistent state")


def _join_from_env(backend: str, timeout_s: float) -> tuple[Generation, Any]:
    gen = Generation(index=env.env_int(env.HOTSPARE_GENERATION, 0), rank=env.env_int("RANK"),
                     world_size=env.env_int("WORLD_SIZE"))
    store = store_from_env()
    join(store, gen, backend, timeout_s)
    return gen, store


def initialize(model: torch.nn.Module, config: dict | str, *, model_parameters=None, optimizer=None,
               lr_scheduler=None, training_data=None, collective_timeout_s: float | None = None, data_state=None,
               load_data_state=None, **kwargs) -> Session:
    """``deepspeed.initialize`` with hotspare: validates the ``"hotspare"`` section first.

    The process group is joined through the launcher's control store (``hotspare-run``), on
    the generation's own store prefix, unless the caller already initialised one.
    ``data_state`` (optional) returns the data position as JSON-able values; it is mirrored,
    and ``load_data_state`` gets it back at a restore.
    With mirroring on, ``engine.step()`` mirrors the unique state after every optimizer step.

    A spare (``HOTSPARE_ROLE=spare``, started by ``hotspare-run --spares-per-node``) waits
    here for a takeover order; it returns a Session for the rank it took, restored to the
    landing version, or exits the process (status 0) when the job ends first.
    """
    ds_config, hs_config = split_deepspeed_config(config)
    env.configure_accelerator()
    import deepspeed

    check_version()
    from deepspeed.accelerator import get_accelerator

    backend = get_accelerator().communication_backend_name()
    if collective_timeout_s is None:
        collective_timeout_s = hs_config.recovery.collective_timeout_s if hs_config is not None else 120.0
    spare = role() == "spare"
    store, heartbeat, plan = None, None, None
    if spare:
        if hs_config is None or not hs_config.enabled or not hs_config.recovery.enabled:
            raise ConfigError("this process was started as a spare, but the config's \"hotspare\" section is "
                              "missing or has recovery off; give the job's config to every worker")
        store = store_from_env()
        heartbeat = _heartbeat(hs_config, store)
        warm_up_spare()
        # The coordinator names the rank as soon as the failure is reported (Prepare), so the
        # engine is built while it settles and plans; the order (the plan) follows.
        order = _wait_for_takeover(store, heartbeat, prepare=True)
        t_order = time.monotonic()
        if isinstance(order, control.Prepare):
            rank, world, generation = order.rank, order.world_size, order.generation
        else:
            plan = order
            rank, world, generation = plan.rank_of(worker_id()), plan.world_size, plan.generation
        gen = Generation(generation - 1, rank, world)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        # The dead rank's device index on its node (free now that it died). A spare on another
        # node would need a device its launcher reserved: not built yet (CPU-only so far).
        os.environ["LOCAL_RANK"] = str(rank % env.env_int("LOCAL_WORLD_SIZE", world))
        # Build rank R's engine with no peers (torch's fake group: collectives do nothing), then
        # join the survivors' real generation and re-point exactly as they do.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    elif dist.is_initialized():
        gen = Generation(index=0, rank=dist.get_rank(), world_size=dist.get_world_size())
    else:
        gen, store = _join_from_env(backend, collective_timeout_s)
        if hs_config is not None and hs_config.enabled and hs_config.recovery.enabled:
            heartbeat = _heartbeat(hs_config, store)
    deepspeed.init_distributed(dist_backend=backend)
    # DeepSpeed creates its groups without a timeout (torch's default: 30 min for gloo, 10 for
    # NCCL); they get the job's collective timeout, the backstop that finds a stuck peer.
    with default_group_timeout(collective_timeout_s):
        engine, opt, loader, sched = deepspeed.initialize(
            model=model, config=ds_config, model_parameters=model_parameters, optimizer=optimizer,
            lr_scheduler=lr_scheduler, training_data=training_data, **kwargs)
    if engine.zero_optimization_stage() not in (1, 2, 3):
        raise ValueError(f"zero_optimization.stage={engine.zero_optimization_stage()}: hotspare needs ZeRO stage "
                         f"1, 2 or 3 (each rank's unique state is its ZeRO partition)")
    session = Session(engine=engine, optimizer=opt, training_dataloader=loader, lr_scheduler=sched,
                      config=hs_config, generation=gen, store=store, heartbeat=heartbeat, spare=spare,
                      backend=backend)
    if hs_config is None or not hs_config.enabled:
        return session
    session.events = EventLog(hs_config.events_dir, gen.rank, gen.index)
    session.state = DeepSpeedState(engine, data_state, load_data_state)
    session.keeper = _keeper(hs_config)
    if hs_config.checkpoint.enabled:
        session.checkpoints = engine.checkpoint_engine = checkpoint.make_engine(
            gen.rank, gen.world_size, hs_config.checkpoint.keep, session.events)
    _wrap_step(session)
    if spare:
        records = rebuild.find_groups(session.roots())
        leave()  # the fake group
        t_built = time.monotonic()
        if plan is None:
            plan = _wait_for_takeover(store, heartbeat)
            if plan.rank_of(worker_id()) != rank:
                raise RecoveryError(f"spare {worker_id()} built rank {rank}'s engine as told, but the plan for "
                                    f"generation {plan.generation} gives it rank {plan.rank_of(worker_id())}")
        session.events("takeover", generation=plan.generation, replaced=plan.replaced)
        session._land(plan, plan.generation, records, None, {"engine_build_s": t_built - t_order}, t_order)
    elif gen.world_size > 1:
        session._start_mirror(*session._hotspare_groups())
    return session


@contextlib.contextmanager
def default_group_timeout(seconds: float):
    """Within the block, a process group created without a timeout gets ``seconds``.

    torch reads ``distributed_c10d.default_pg_timeout`` (``default_pg_nccl_timeout`` for NCCL)
    when ``new_group`` is given none (pinned by tests/test_recovery_pieces.py).
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    saved = {name: getattr(c10d, name) for name in ("default_pg_timeout", "default_pg_nccl_timeout")
             if hasattr(c10d, name)}
    for name, value in saved.items():
        if isinstance(value, datetime.timedelta):
            setattr(c10d, name, timeout)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(c10d, name, value)


# Modules deepspeed.initialize imports lazily, on its first call. A spare imports them while
# it waits: in 0.19.8 the Muon optimizer module alone (imported by the ZeRO optimizer check)
# took 2.0 of the 2.1 s a spare's ZeRO-2 engine build took after its order; with it imported
# first the build takes 0.03 s (tests/test_recovery_pieces.py pins that these exist).
LAZY_IMPORTS = (
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.module_inject.auto_ep_config",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.parameter_offload",
    "deepspeed.runtime.zero.partitioned_param_coordinator",
)


def warm_up_spare() -> list[str]:
    """Do what a spare's engine build would do after its order and needs no rank or group: the
    lazy imports, DeepSpeed's op-compatibility probe and loading its shared-memory comm op
    (0.15 s of ``deepspeed.init_distributed`` on CPU, measured; 0.003 s after this). Returns
    what was missing (a DeepSpeed version that moved it: the build then does its own)."""
    import importlib

    missing = []
    for name in LAZY_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    try:
        ops = importlib.import_module("deepspeed.ops")
        getattr(ops, "__compatible_ops__")  # probes every op builder once (imports setuptools)
        importlib.import_module("deepspeed.comm.torch").build_shm_op()  # None on accelerators without it
    except (ImportError, AttributeError):
        missing.append("deepspeed.comm.torch.build_shm_op")
    return missing


def _keeper(cfg: HotspareConfig) -> KeeperClient | None:
    if not (cfg.retain.keeper and cfg.mirror.enabled):
        return None
    path = os.environ.get(env.HOTSPARE_KEEPER_SOCKET)
    if not path:
        _log("hotspare.retain.keeper is on, but no keeper runs for this process (start it with hotspare-run): "
             "its state is kept in its own memory and its peers' only")
        return None
    return KeeperClient(path)


def _heartbeat(cfg: HotspareConfig, store) -> Heartbeat | None:
    if store is None or not cfg.recovery.enabled:
        return None
    return Heartbeat(worker_id(), cfg.recovery.heartbeat_interval_s, cfg.recovery.heartbeat_timeout_s)


def _wait_for_takeover(store, heartbeat, prepare: bool = False):
    try:
        return wait_for_order(store, worker_id(), prepare)
    except Shutdown:
        if heartbeat is not None:
            heartbeat.close()
        raise SystemExit(0) from None


def node_ranks(group=None) -> list[int]:
    """Every rank's (logical) node, gathered as tensors over ``group`` (default: the default group)."""
    mine = torch.tensor([env.env_int(env.HOTSPARE_NODE_RANK, 0)], dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(t) for t in out]


def _wrap_step(session: Session) -> None:
    """Wrap the one call every DeepSpeed loop makes: after an optimizer step (global_steps moved)
    the post-step state is captured and its copy starts on the mirror thread."""
    engine = session.engine
    step = engine.step

    def step_and_mirror(*args, **kw):
        before = engine.global_steps
        out = step(*args, **kw)
        if engine.global_steps == before:
            return out  # a micro-step inside gradient accumulation
        mirror = session.mirror
        if mirror is not None:
            mirror.on_step(engine.global_steps, session.state.tensors, session.state.meta)
        if session.checkpoints is not None and engine.global_steps % session.config.checkpoint.every == 0:
            session.save_checkpoint()
        return out

    engine.step = step_and_mirror


def fp32_partitions(engine) -> list[torch.Tensor]:
    """This rank's flat fp32 master partitions (the tensors its inner optimizer steps)."""
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    if stage in (1, 2):
        return list(opt.single_partition_of_fp32_groups)
    if stage == 3:
        return list(opt.fp32_partitioned_groups_flat)
    raise ValueError(f"ZeRO stage {stage} has no fp32 partition")


def optimizer_state_tensors(engine) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the inner optimizer's state of this rank's partitions."""
    inner = engine.optimizer.optimizer
    out = []
    for i, part in enumerate(fp32_partitions(engine)):
        for key, value in sorted(inner.state.get(part, {}).items()):
            if torch.is_tensor(value):
                out.append((f"{i}.{key}", value))
    return out


SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


class DeepSpeedState:
    """The unique state of one rank of a ZeRO engine: what no other rank holds (the razor).

    Tensors: the fp32 master partitions, the inner optimizer's state for them, the torch
    RNG states. Metadata (JSON): engine counters, LR scheduler, loss scaler, the inner
    optimizer's hyper-parameters, Python and NumPy RNG states, and the caller's data position.
    Replicated state (bit16 weights under ZeRO 1/2, buffers) is not here: at recovery it
    comes from a live replica.
    """

    def __init__(self, engine, data_state=None, load_data_state=None):
        self.engine = engine
        self.data_state = data_state
        self.load_data_state = load_data_state
        self._accel = None
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
        if accel.device_name() != "cpu":
            self._accel = accel

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = [(f"fp32.{i}", p) for i, p in enumerate(fp32_partitions(self.engine))]
        named += [(f"optim.{n}", t.reshape(-1)) for n, t in optimizer_state_tensors(self.engine)]
        named.append(("rng.torch", torch.get_rng_state()))
        if self._accel is not None:
            named.append(("rng.accelerator", self._accel.get_rng_state()))
        # The Mersenne-Twister words of Python's and NumPy's generators travel as tensors: as
        # JSON they were most of the metadata's bytes and of its per-step encoding time.
        named.append(("rng.python", torch.tensor(random.getstate()[1], dtype=torch.int64)))
        named.append(("rng.numpy", torch.from_numpy(np.random.get_state()[1].astype(np.int64))))
        return named

    def meta(self) -> dict:
        e = self.engine
        inner = e.optimizer.optimizer
        py_state, np_state = random.getstate(), np.random.get_state()  # each read once: this runs every step
        meta = {
            "engine": {k: int(getattr(e, k)) for k in ENGINE_COUNTERS},
            "param_groups": [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in inner.param_groups],
            # The rest of the two generators' states (their words are tensors, above).
            "rng_python": {"version": py_state[0], "gauss_next": py_state[2]},
            "rng_numpy": dict(zip(("kind", "pos", "has_gauss", "cached_gaussian"),
                                  _jsonable([np_state[i] for i in (0, 2, 3, 4)]))),
        }
        if e.lr_scheduler is not None:
            meta["lr_scheduler"] = _jsonable(e.lr_scheduler.state_dict())
        scaler = getattr(e.optimizer, "loss_scaler", None)
        if scaler is not None:
            meta["loss_scaler"] = {k: _jsonable(getattr(scaler, k)) for k in SCALER_FIELDS if hasattr(scaler, k)}
        if self.data_state is not None:
            meta["data"] = _jsonable(self.data_state())
        return meta

    def restore(self, buf: torch.Tensor, layout: Layout) -> None:
        """Put the state of snapshot ``buf`` (laid out as ``layout``) back into the engine, in place.

        Tensors are copied into the live fp32 partitions and optimizer state (so every alias
        DeepSpeed holds sees them); counters, param groups, scheduler, loss scaler, RNG states
        and the data position come from the metadata. :meth:`resync` must follow.
        """
        self._conform(layout)
        views = {seg.name: v for seg, v in zip(layout.segments, layout.views(buf))}
        meta = read_meta(buf, layout)
        with torch.no_grad():  # the fp32 partitions are leaves that require grad
            for name, live in self.tensors():
                if not name.startswith("rng."):
                    live.copy_(views[name])
        self._apply(meta, views)

    def extras(self) -> dict:
        """What a DeepSpeed checkpoint lacks for a bitwise resume: the metadata and the RNG states."""
        return {"meta": self.meta(), "rng": {n: t.clone() for n, t in self.tensors() if n.startswith("rng.")}}

    def load_checkpoint(self, directory: str, tag: str) -> None:
        """Load a checkpoint saved by :meth:`Session.save_checkpoint` into the engine, in place, with
        the bit16 weights re-derived (collective: every rank)."""
        self._clear_interrupted_step()
        path, client = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if path is None:
            raise RecoveryError(f"DeepSpeed could not load the checkpoint {os.path.join(directory, tag)}")
        extras = (client or {}).get("hotspare")
        if extras is None:
            raise RecoveryError(f"the checkpoint {path} was not saved by hotspare (no RNG states or data position "
                                f"in its client state); resuming from it would not be the same run")
        self._apply(extras["meta"], extras["rng"])
        self._derive_replicated()

    def _apply(self, meta: dict, views: dict) -> None:
        """Counters, param groups, scheduler, loss scaler, RNG states and data position."""
        torch.set_rng_state(views["rng.torch"].clone())
        if self._accel is not None and "rng.accelerator" in views:
            self._accel.set_rng_state(views["rng.accelerator"].clone())
        py = meta["rng_python"]
        random.setstate((py["version"], tuple(int(x) for x in views["rng.python"].tolist()), py["gauss_next"]))
        npm = meta["rng_numpy"]
        np.random.set_state((npm["kind"], views["rng.numpy"].numpy().astype(np.uint32), npm["pos"],
                             npm["has_gauss"], npm["cached_gaussian"]))
        e = self.engine
        for k, v in meta["engine"].items():
            setattr(e, k, v)
        inner = e.optimizer.optimizer
        for group, saved in zip(inner.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                group[k] = type(group[k])(v) if isinstance(group.get(k), tuple) else v
        if e.lr_scheduler is not None and "lr_scheduler" in meta:
            e.lr_scheduler.load_state_dict(meta["lr_scheduler"])
        scaler = getattr(e.optimizer, "loss_scaler", None)
        for k, v in meta.get("loss_scaler", {}).items():
            setattr(scaler, k, v)
        if "data" in meta and self.load_data_state is not None:
            self.load_data_state(meta["data"])

    def layout_for(self, layout_id: int) -> Layout | None:
        """This engine's layout that has id ``layout_id`` (with or without optimizer state), or None.

        A snapshot of version 0 has no optimizer state (torch optimizers create it at their
        first step); every later one has. An engine that has not stepped yet (a spare) gets its
        optimizer state created (then overwritten by the restore) to take a later version.
        """
        layout = Layout.of(self.tensors())
        if layout.id == layout_id:
            return layout
        had = bool(optimizer_state_tensors(self.engine))
        self._set_optimizer_state(not had)
        other = Layout.of(self.tensors())
        if other.id == layout_id:
            return other
        self._set_optimizer_state(had)
        return None

    def _conform(self, layout: Layout) -> None:
        wants = any(s.name.startswith("optim.") for s in layout.segments)
        if wants != bool(optimizer_state_tensors(self.engine)):
            self._set_optimizer_state(wants)
        if not layout.matches(self.tensors()):
            raise RecoveryError("the snapshot's layout does not match this engine's unique state; is every rank "
                                "running the same model and config?")

    def _set_optimizer_state(self, present: bool) -> None:
        """Create (one zero-gradient step at lr 0) or drop the inner optimizer's per-partition state.

        Either way the restore then overwrites every value: what matters is that the tensors
        exist with the optimizer's own shapes and dtypes (or, for version 0, do not).
        """
        inner = self.engine.optimizer.optimizer
        parts = fp32_partitions(self.engine)
        if not present:
            for p in parts:
                inner.state.pop(p, None)
            return
        saved = [dict(g) for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
        grads = [p.grad for p in parts]
        for p in parts:
            p.grad = torch.zeros_like(p)
        zero3 = self.engine.zero_optimization_stage() == 3
        if zero3:  # ZeRO 3 hands its partitions to the inner optimizer only for the step
            self.engine.optimizer._set_fp32_optimizer_param_groups()
        try:
            inner.step()
        finally:
            if zero3:
                self.engine.optimizer._clear_fp32_optimizer_param_groups()
            for p, grad in zip(parts, grads):
                p.grad = grad
            for g, s in zip(inner.param_groups, saved):
                g.update(s)

    def resync(self) -> None:
        """After :meth:`restore`: drop the interrupted step's leftovers, then derive the replicated
        state (the bit16 weights) from the restored fp32 partitions. Collective (all ranks)."""
        self._clear_interrupted_step()
        self._derive_replicated()

    def _derive_replicated(self) -> None:
        """The bit16 weights from the fp32 partitions (collective)."""
        opt = self.engine.optimizer
        if self.engine.zero_optimization_stage() in (1, 2):
            opt.update_lp_params()  # fp32 -> this rank's bit16 partition, then all-gather
        else:
            opt._partition_all_parameters()
            for i in range(len(opt.fp32_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(i)
            opt.checkpoint_event_epilogue()
            # A rank whose engine is new has no forward trace while survivors have one: every
            # rank starts tracing again, or their prefetch decisions (and collectives) diverge.
            coord = opt.parameter_offload.get_param_coordinator()
            if not coord.is_invalid_trace():
                coord._invalidate_trace()

    def _clear_interrupted_step(self) -> None:
        """The leftovers of a step cut short: partial gradients, buckets, in-flight gathers (local)."""
        e = self.engine
        opt = e.optimizer
        stage = e.zero_optimization_stage()
        _reset_backward_state(opt)
        e._running_engine_step = False
        if stage in (1, 2):
            for bucket in opt.ipg_buckets.values():
                bucket.clear()
                bucket.index = 0
            opt.extra_large_param_to_reduce.clear()
            opt.previous_reduced_grads.clear()
            opt.params_already_reduced[:] = [False] * len(opt.params_already_reduced)
            opt.averaged_gradients.clear()
            opt.all_grad_tensors.clear()
            opt._release_ipg_buffers()
            opt.reset_partition_gradient_structures()
            opt.micro_step_id = -1
            opt.zero_grad(set_to_none=True)
            for part in opt.single_partition_of_fp32_groups:
                part.grad = None
        else:
            _reset_zero3(e, opt)

    def bytes_per_param(self) -> float:
        """Unique bytes this rank mirrors per model parameter (all ranks together)."""
        nbytes = sum(t.numel() * t.element_size() for _, t in self.tensors())
        world = dist.get_world_size() if dist.is_initialized() else 1
        num_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.engine.module.parameters())
        return nbytes * world / max(1, num_params)


def _reset_backward_state(opt) -> None:
    hooks = getattr(opt, "_backward_hook_state", None)
    if hooks is not None:
        hooks.reset_for_new_step()
        hooks.backward_active_depth = 0
        hooks.remaining_grad_acc_hooks = 0


def _reset_zero3(engine, opt) -> None:
    """ZeRO 3's per-step leftovers of an interrupted forward or backward."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    # Gradients left by the interrupted backward go first: DeepSpeed's zero_grad calls
    # record_stream on them, which fails on the CPU accelerator (its stream is None).
    for group in opt.fp16_groups:
        for p in group:
            p.grad = None
    opt.zero_grad(set_to_none=True)  # also resets micro_step_id and the epilogue flag
    for bucket in opt.ipg_buckets.values():
        bucket.clear_params()
    for key in opt.params_already_reduced:
        opt.params_already_reduced[key] = False
    opt.averaged_gradients.clear()
    for part in opt.fp32_partitioned_groups_flat:
        part.grad = None
    opt._offload_boundary_param_ids = set()
    registry = getattr(engine.module, "ds_inflight_param_registry", None)
    if registry is not None:
        registry.clear()  # handles of the dead generation's all-gathers: never waited on
    for p in engine.module.parameters():
        if getattr(p, "ds_status", None) == ZeroParamStatus.INFLIGHT:
            p.ds_status = ZeroParamStatus.AVAILABLE  # partitioned again below
    del parameter_offload.FWD_MODULE_STACK[:]
    for m in engine.module.modules():
        if hasattr(m._parameters, "_in_forward"):
            m._parameters._in_forward = False
    opt.parameter_offload.get_param_coordinator().release_backward_leftovers()


def _jsonable(value):
    """Python/NumPy/torch scalars and containers as JSON types; anything else is an error."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    raise TypeError(f"cannot mirror a value of type {type(value).__name__} ({value!r:.80}); unique state metadata "
                    f"must be numbers, strings, lists or dicts")
