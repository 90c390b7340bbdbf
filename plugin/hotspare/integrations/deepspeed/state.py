"""A ZeRO rank's unique state (:class:`DeepSpeedState`): its fp32 master partitions, the inner
optimizer's state for them, its own buffers and ZeRO 3 frozen partitions, the engine's counters,
scheduler and loss scaler; what a restore puts back and re-derives (bit16 weights, frozen
parameters from a replica).

Internals read here (pinned by tests/test_deepspeed_internals.py, which fail loudly on a
DeepSpeed upgrade that moves them):
- ZeRO 1/2 ``DeepSpeedZeroOptimizer.single_partition_of_fp32_groups[i]``: the flat fp32
  master partition of param group i; the inner optimizer's only parameter of that group.
- ZeRO 3 ``DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat[j]``: the flat fp32
  partition of sub-group j; the inner optimizer's parameters.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ...events import log
from ...recovery import RecoveryError
from ...startup import gather_ints
from ..base import HostState, zero_gradient_step
from ..optim_state import (NativeSteps, changed_attributes, coverage, from_json, jsonable, plain_attributes, plain_state,
                           set_plain_state)
from . import zero


def fp32_partitions(engine) -> list[torch.Tensor]:
    """This rank's flat fp32 master partitions (the tensors its inner optimizer steps)."""
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    if stage in (1, 2):
        return list(opt.single_partition_of_fp32_groups)
    if stage == 3:
        return list(opt.fp32_partitioned_groups_flat)
    raise ValueError(f"ZeRO stage {stage} has no fp32 partition")


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(qualified name, owning module, attribute) of each persistent buffer of ``module`` whose dtype a
    snapshot can hold. Non-persistent buffers (causal masks, RoPE frequencies) are derived from the
    config and not saved by ``state_dict`` either; :meth:`DeepSpeedState.watch` warns when one changes."""
    from ...snapshot import DTYPES

    out = []
    for prefix, m in module.named_modules():
        for attr, b in m._buffers.items():
            if b is not None and attr not in m._non_persistent_buffers_set and str(b.dtype) in DTYPES:
                out.append((f"{prefix}.{attr}" if prefix else attr, m, attr))
    return out


def partition_groups(engine) -> list[dict]:
    """The inner optimizer's param group each fp32 partition steps with."""
    opt = engine.optimizer
    groups = opt.optimizer.param_groups
    if engine.zero_optimization_stage() == 3:
        return [groups[opt.sub_group_to_group_id[j]] for j in range(len(opt.fp32_partitioned_groups_flat))]
    return list(groups)


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

# What DeepSpeedState.watch knows: plain attributes that change from step to step and are captured
# (the counters, the loss scaler's fields). No other plain attribute of the engine, its optimizers,
# the loss scaler or the scheduler changed between two steps in any configuration tried here.
CAPTURED_ATTRIBUTES = {"engine": set(ENGINE_COUNTERS), "loss scaler": set(SCALER_FIELDS)}


class DeepSpeedState(HostState):
    """The unique state of one rank of a ZeRO engine: what no other rank holds (the razor).

    Tensors: the fp32 master partitions, the inner optimizer's state for them, the torch
    RNG states. Metadata (JSON): engine counters, LR scheduler, loss scaler, the inner
    optimizer's hyper-parameters, Python and NumPy RNG states, and the caller's data position.
    Replicated state (bit16 weights under ZeRO 1/2, buffers) is not here: at recovery it
    comes from a live replica.
    """

    def __init__(self, engine, data_state=None, load_data_state=None, spare: bool = False):
        super().__init__(data_state, load_data_state)
        self.engine = engine
        self._accel = None
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
        if accel.device_name() != "cpu":
            self._accel = accel
        self._native = NativeSteps.of(engine.optimizer.optimizer, fp32_partitions(engine), partition_groups(engine),
                                      accel.device_name())
        self._buffers = persistent_buffers(engine.module)
        frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
        self._frozen_partitions = [(n, p) for n, p in frozen if hasattr(p, "ds_tensor")]
        self._frozen_replicated = [p for _, p in frozen if not hasattr(p, "ds_tensor")]
        self._replicas_valid = not spare
        """Whether this rank's replicated values (frozen parameters) are the job's: a spare's come from
        its own initialisation until the first restore fetches them from a rank whose are."""
        self.watching = True
        """True until :meth:`watch` has compared two optimizer steps."""
        self._watched: dict | None = None

    def _unsaved_buffers(self) -> dict[str, int]:
        """A CRC-32 of each buffer the capture leaves out (non-persistent, or of a dtype a snapshot
        cannot hold), to see whether training changes one (run twice, at start-up)."""
        import zlib

        saved = {name for name, _, _ in self._buffers}
        return {n: zlib.crc32(b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                for n, b in self.engine.module.named_buffers() if n not in saved}

    def _watched_objects(self) -> dict:
        e = self.engine
        objects = {"engine": e, "ZeRO optimizer": e.optimizer, "optimizer": e.optimizer.optimizer}
        scaler = getattr(e.optimizer, "loss_scaler", None)
        if scaler is not None:
            objects["loss scaler"] = scaler
        if e.lr_scheduler is not None:
            objects["LR scheduler"] = e.lr_scheduler
        return objects

    def watch(self, say: bool) -> list[str]:
        """The guard against a silent wrong restore, run after the first two optimizer steps: what
        the engine and its optimizer hold that changed between them and that the capture misses
        (plain attributes outside what :meth:`meta` and the scheduler's state carry), and what
        :func:`optim_state.coverage` finds in the optimizer. Logged (``say``) and returned."""
        now = {name: plain_attributes(obj) for name, obj in self._watched_objects().items()}
        now["buffers"] = self._unsaved_buffers()
        if self._watched is None:
            self._watched = now
            return []
        self.watching = False
        problems = coverage(self.engine.optimizer.optimizer, fp32_partitions(self.engine),
                            captured_tensor_ids={id(t) for _, t in optimizer_state_tensors(self.engine)})
        for buf in changed_attributes(self._watched["buffers"], now["buffers"], captured=set(), ignored=set()):
            problems.append(f"buffer {buf!r} of the model changed between two steps and is not captured (it is "
                            f"registered with persistent=False, or its dtype is not one a snapshot holds)")
        for name, obj in self._watched_objects().items():
            captured = CAPTURED_ATTRIBUTES.get(name, set())
            if name == "LR scheduler":
                captured = set(obj.state_dict())
            for attr in changed_attributes(self._watched.get(name, {}), now[name], captured=captured,
                                           ignored=set()):
                problems.append(f"{name} ({type(obj).__qualname__}) attribute {attr!r} changed between two steps "
                                f"and is not part of what hotspare captures")
        self._watched = None
        if say:
            for line in problems:
                log(f"WARNING: a recovery may not be bitwise exact: {line}")
        return problems

    def unique_tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = [(f"fp32.{i}", p) for i, p in enumerate(fp32_partitions(self.engine))]
        named += [(f"optim.{n}", t.reshape(-1)) for n, t in optimizer_state_tensors(self.engine)]
        # Each rank's own buffers (a running statistic is computed from the rank's own data), and
        # under ZeRO 3 its partitions of frozen parameters (no other rank holds them).
        named += [(f"buffer.{name}", module._buffers[attr].reshape(-1)) for name, module, attr in self._buffers]
        named += [(f"frozen.{name}", p.ds_tensor.reshape(-1)) for name, p in self._frozen_partitions]
        return named

    def device_rng_states(self) -> list[tuple[str, torch.Tensor]]:
        return [] if self._accel is None else [("rng.accelerator", self._accel.get_rng_state())]

    def set_device_rng_states(self, views: dict) -> None:
        if self._accel is not None and "rng.accelerator" in views:
            self._accel.set_rng_state(views["rng.accelerator"].clone())

    def host_meta(self) -> dict:
        e = self.engine
        inner = e.optimizer.optimizer
        meta = {
            "engine": {k: int(getattr(e, k)) for k in ENGINE_COUNTERS},
            "param_groups": [{k: jsonable(v) for k, v in g.items() if k != "params"} for g in inner.param_groups],
            # Plain values of the per-partition state: FusedAdam's and CPU Adam's ``step`` is an int.
            "optim_plain": plain_state(inner, fp32_partitions(e)),
        }
        if e.lr_scheduler is not None:
            meta["lr_scheduler"] = jsonable(e.lr_scheduler.state_dict())
        scaler = getattr(e.optimizer, "loss_scaler", None)
        if scaler is not None:
            meta["loss_scaler"] = {k: jsonable(getattr(scaler, k)) for k in SCALER_FIELDS if hasattr(scaler, k)}
        return meta

    def before_restore(self) -> None:
        if self._native is not None:
            self._native.prepare()

    def load_checkpoint(self, directory: str, tag: str) -> None:
        """Load a checkpoint saved by :meth:`Session.save_checkpoint` into the engine, in place, with
        the bit16 weights re-derived (collective: every rank)."""
        zero.clear_interrupted_step(self.engine)
        if self._native is not None:
            self._native.prepare()
        path, client = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if path is None:
            raise RecoveryError(f"DeepSpeed could not load the checkpoint {os.path.join(directory, tag)}")
        extras = (client or {}).get("hotspare")
        if extras is None:
            raise RecoveryError(f"the checkpoint {path} was not saved by hotspare (no RNG states or data position "
                                f"in its client state); resuming from it would not be the same run")
        self.load_extras(extras)
        self._replicas_valid = True  # DeepSpeed loaded the module's frozen parameters from the files
        self._derive_replicated()

    def apply_host_meta(self, meta: dict, views: dict) -> None:
        """Counters, param groups, the optimizer's plain state, scheduler and loss scaler."""
        e = self.engine
        for k, v in meta["engine"].items():
            setattr(e, k, v)
        inner = e.optimizer.optimizer
        for group, saved in zip(inner.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                v = from_json(v)
                group[k] = type(group[k])(v) if isinstance(group.get(k), tuple) else v
        set_plain_state(inner, fp32_partitions(e), meta["optim_plain"])
        if self._native is not None:
            self._native.resync()  # after the plain state: it reads the landing step from there
        if e.lr_scheduler is not None and "lr_scheduler" in meta:
            e.lr_scheduler.load_state_dict(from_json(meta["lr_scheduler"]))
        scaler = getattr(e.optimizer, "loss_scaler", None)
        for k, v in meta.get("loss_scaler", {}).items():
            setattr(scaler, k, from_json(v))

    def has_optimizer_state(self) -> bool:
        return bool(optimizer_state_tensors(self.engine))

    def set_optimizer_state(self, present: bool) -> None:
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
        zero3 = self.engine.zero_optimization_stage() == 3
        if zero3:  # ZeRO 3 hands its partitions to the inner optimizer only for the step
            self.engine.optimizer._set_fp32_optimizer_param_groups()
        try:
            zero_gradient_step(inner, parts)
        finally:
            if zero3:
                self.engine.optimizer._clear_fp32_optimizer_param_groups()

    def resync(self) -> None:
        """After :meth:`restore`: drop the interrupted step's leftovers, then derive the replicated
        state (the bit16 weights) from the restored fp32 partitions. Collective (all ranks)."""
        zero.clear_interrupted_step(self.engine)
        self._derive_replicated()

    def _fetch_frozen(self) -> None:
        """ZeRO 1/2's frozen parameters from a rank whose are the job's (collective over the
        data-parallel group; every rank calls it, and does nothing when the model has none)."""
        if not self._frozen_replicated:
            return
        group = self.engine.seq_data_parallel_group
        valid = gather_ints(int(self._replicas_valid), group)
        if all(valid):
            return
        if not any(valid):
            raise RecoveryError("no rank holds the job's frozen parameters (every rank is new); load a checkpoint")
        src = dist.get_global_rank(group, valid.index(1))
        for p in self._frozen_replicated:
            dist.broadcast(p.data, src, group=group)
        self._replicas_valid = True

    def _derive_replicated(self) -> None:
        """The bit16 weights from the fp32 partitions, and the frozen parameters from a live replica
        (collective)."""
        self._fetch_frozen()
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

    def bytes_per_param(self) -> float:
        """Unique bytes this rank mirrors per model parameter (all ranks together)."""
        nbytes = sum(t.numel() * t.element_size() for _, t in self.tensors())
        world = dist.get_world_size() if dist.is_initialized() else 1
        num_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.engine.module.parameters())
        return nbytes * world / max(1, num_params)
