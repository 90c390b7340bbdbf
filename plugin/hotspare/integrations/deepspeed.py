"""DeepSpeed integration: start-up through hotspare, and access to ZeRO's partitions.

Internals read here (pinned by tests/test_deepspeed_internals.py, which fail loudly on a
DeepSpeed upgrade that moves them):
- ZeRO 1/2 ``DeepSpeedZeroOptimizer.single_partition_of_fp32_groups[i]``: the flat fp32
  master partition of param group i; the inner optimizer's only parameter of that group.
- ZeRO 3 ``DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat[j]``: the flat fp32
  partition of sub-group j; the inner optimizer's parameters.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import checkpoint, env, identity
from ..config import split_deepspeed_config, to_mapping
from ..events import EventLog, log
from ..generation import Generation
from ..position import NO_DATA_HOOKS, data_hooks
from ..recovery import RecoveryError
from ..session import Session
from ..startup import (await_takeover, default_group_timeout, gather_ints, goodbye_on_error, heartbeat_for,
                       import_modules, join_from_env, keeper_for, node_ranks)
from ..snapshot import Layout, read_meta
from ..worker import role
from .optim_state import (NativeSteps, changed_attributes, coverage, from_json, jsonable, plain_attributes, plain_state,
                          set_plain_state)

__all__ = ["DeepSpeedSession", "DeepSpeedState", "default_group_timeout", "initialize", "node_ranks",
           "warm_up_spare"]

SUPPORTED_DEEPSPEED = ("0.19.",)


def check_version() -> str:
    import deepspeed

    if not deepspeed.__version__.startswith(SUPPORTED_DEEPSPEED):
        raise RuntimeError(
            f"hotspare supports DeepSpeed {', '.join(v + 'x' for v in SUPPORTED_DEEPSPEED)}, found "
            f"{deepspeed.__version__}; install a supported version (requirements.txt pins one)")
    return deepspeed.__version__


@dataclass(kw_only=True)
class DeepSpeedSession(Session):
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
    state: "DeepSpeedState | None" = None
    """What this rank mirrors."""

    def step_count(self) -> int:
        return self.engine.global_steps

    def interruptible(self) -> list:
        # ZeRO 1/2's forward runs no collective: the blocks of the model check for the alarm
        # (modules with children: a hook per block, not per layer). ZeRO 3's forward gathers
        # parameters, which raise at once on the broken connections (and a hook raising between
        # its own fetch hooks would leave its parameter coordinator mid-fetch).
        if self.engine.zero_optimization_stage() == 3:
            return []
        return [m for m in self.engine.module.modules() if next(m.children(), None) is not None]

    def roots(self) -> list:
        """Where DeepSpeed keeps process-group handles (walked by :mod:`hotspare.rebuild`)."""
        import deepspeed.comm.comm
        import deepspeed.utils.groups

        return [self.engine, deepspeed.utils.groups, deepspeed.comm.comm]

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


def initialize(model: torch.nn.Module, config: dict | str, *, model_parameters=None, optimizer=None,
               lr_scheduler=None, training_data=None, collective_timeout_s: float | None = None, data_state=None,
               load_data_state=None, **kwargs) -> DeepSpeedSession:
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
    data_state, load_data_state, data_said = data_hooks(data_state, load_data_state)
    env.configure_accelerator()
    import deepspeed

    check_version()
    from deepspeed.accelerator import get_accelerator

    backend = get_accelerator().communication_backend_name()
    if collective_timeout_s is None:
        collective_timeout_s = hs_config.recovery.collective_timeout_s if hs_config is not None else 120.0
    spare = role() == "spare"
    store, heartbeat = None, None
    fp = identity.fingerprint({"deepspeed": ds_config, "hotspare": to_mapping(hs_config) if hs_config else None},
                              {"deepspeed": deepspeed.__version__})
    if spare:
        order = await_takeover(hs_config, lambda: warm_up_spare(ds_config), fp)
        store, heartbeat = order.store, order.heartbeat
        gen = Generation(order.generation - 1, order.rank, order.world_size)
    elif dist.is_initialized():
        gen = Generation(index=0, rank=dist.get_rank(), world_size=dist.get_world_size())
    else:
        gen, store = join_from_env(backend, collective_timeout_s, fp)
        if hs_config is not None and hs_config.enabled and hs_config.recovery.enabled:
            heartbeat = heartbeat_for(hs_config, store)
    deepspeed.init_distributed(dist_backend=backend)
    # DeepSpeed creates its groups without a timeout (torch's default: 30 min for gloo, 10 for
    # NCCL); they get the job's collective timeout, the backstop that finds a stuck peer.
    with goodbye_on_error(heartbeat), default_group_timeout(collective_timeout_s):
        engine, opt, loader, sched = deepspeed.initialize(
            model=model, config=ds_config, model_parameters=model_parameters, optimizer=optimizer,
            lr_scheduler=lr_scheduler, training_data=training_data, **kwargs)
        if engine.zero_optimization_stage() not in (1, 2, 3):
            raise ValueError(f"zero_optimization.stage={engine.zero_optimization_stage()}: hotspare needs ZeRO "
                             f"stage 1, 2 or 3 (each rank's unique state is its ZeRO partition)")
    session = DeepSpeedSession(engine=engine, optimizer=opt, training_dataloader=loader, lr_scheduler=sched,
                               config=hs_config, generation=gen, store=store, heartbeat=heartbeat, spare=spare,
                               backend=backend, pin_memory=get_accelerator().device_name() != "cpu")
    if hs_config is None or not hs_config.enabled:
        if gen.rank == 0:
            why = 'no "hotspare" section' if hs_config is None else '"hotspare": {"enabled": false}'
            log(f"hotspare is off ({why} in the DeepSpeed config): no mirror, keeper or recovery; "
                f'"hotspare": {{}} turns it on with its defaults')
        return session
    session.events = EventLog(hs_config.events_dir, gen.rank, gen.index)
    if not data_said and gen.rank == 0 and not spare:
        log(f"WARNING: {NO_DATA_HOOKS}")
    session.state = DeepSpeedState(engine, data_state, load_data_state, spare=spare)
    session.keeper = keeper_for(hs_config, get_accelerator().device_name())
    if hs_config.checkpoint.enabled:
        session.checkpoints = engine.checkpoint_engine = checkpoint.make_engine(
            gen.rank, gen.world_size, hs_config.checkpoint.keep, session.events)
    _wrap_step(session)
    session.start(order if spare else None)
    return session


# Modules deepspeed.initialize imports lazily, on its first call. A spare imports them while
# it waits: in 0.19.8 the Muon optimizer module alone (imported by the ZeRO optimizer check)
# took 2.0 of the 2.1 s a spare's ZeRO-2 engine build took after its order; with it imported
# first the build takes 0.03 s (tests/test_recovery_pieces.py pins that these exist).
LAZY_IMPORTS = (
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.module_inject.auto_ep_config",
    "deepspeed.module_inject.auto_ep_layer",  # engine._configure_expert_parallel: 11 modules, 4-40 ms
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.parameter_offload",
    "deepspeed.runtime.zero.partitioned_param_coordinator",
)


def optimizer_ops(ds_config: dict) -> list[str]:
    """The op builders DeepSpeed loads to build the optimizer ``ds_config`` names (the choice of
    ``DeepSpeedEngine._configure_basic_optimizer`` and ``get_optimizer_configuration``)."""
    opt = ds_config.get("optimizer") or {}
    kind = str(opt.get("type", "")).lower()
    params = opt.get("params") or {}
    offload = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    cpu = str(offload).lower() in ("cpu", "nvme")
    if kind in ("adam", "adamw"):
        return [] if params.get("torch_adam") else ["CPUAdamBuilder" if cpu else "FusedAdamBuilder"]
    if kind == "adagrad":
        return ["CPUAdagradBuilder"] if cpu else []
    if kind == "lion":
        return ["CPULionBuilder" if cpu else "FusedLionBuilder"]
    if kind == "lamb":
        return ["FusedLambBuilder"]
    return []


def warm_up_spare(ds_config: dict | None = None) -> list[str]:
    """Do what a spare's engine build would do after its order and needs no rank or group: the
    lazy imports, DeepSpeed's op-compatibility probe and loading its shared-memory comm op
    (0.15 s of ``deepspeed.init_distributed`` on CPU, measured; 0.003 s after this), and loading
    the optimizer's op (DeepSpeed's default Adam on CPU is the ``fused_adam`` op: about 2.5 s to
    load at the first engine build, measured). Returns what was missing (a DeepSpeed version
    that moved it: the build then does its own)."""
    import importlib

    missing = import_modules(LAZY_IMPORTS)
    from deepspeed.accelerator import get_accelerator

    for name in optimizer_ops(ds_config or {}):
        try:
            get_accelerator().create_op_builder(name).load()
        except Exception:  # noqa: BLE001 - the engine build then loads (or fails on) it itself
            missing.append(name)
    try:
        ops = importlib.import_module("deepspeed.ops")
        getattr(ops, "__compatible_ops__")  # probes every op builder once (imports setuptools)
        importlib.import_module("deepspeed.comm.torch").build_shm_op()  # None on accelerators without it
    except (ImportError, AttributeError):
        missing.append("deepspeed.comm.torch.build_shm_op")
    return missing


def _wrap_step(session: DeepSpeedSession) -> None:
    """Wrap the one call every DeepSpeed loop makes: after an optimizer step (global_steps moved)
    the post-step state is captured and its copy starts on the mirror thread."""
    engine = session.engine
    step = engine.step

    def step_and_mirror(*args, **kw):
        before = engine.global_steps
        if session.mirror is not None:
            session.mirror.before_update()  # the last capture's device-to-host copy read the state first
        out = step(*args, **kw)
        if engine.global_steps == before:
            return out  # a micro-step inside gradient accumulation
        mirror = session.mirror
        if session.state.watching:
            session.state.watch(session.generation.rank == 0)
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


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(qualified name, owning module, attribute) of each persistent buffer of ``module`` whose dtype a
    snapshot can hold. Non-persistent buffers (causal masks, RoPE frequencies) are derived from the
    config and not saved by ``state_dict`` either; :meth:`DeepSpeedState.watch` warns when one changes."""
    from ..snapshot import DTYPES

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


class DeepSpeedState:
    """The unique state of one rank of a ZeRO engine: what no other rank holds (the razor).

    Tensors: the fp32 master partitions, the inner optimizer's state for them, the torch
    RNG states. Metadata (JSON): engine counters, LR scheduler, loss scaler, the inner
    optimizer's hyper-parameters, Python and NumPy RNG states, and the caller's data position.
    Replicated state (bit16 weights under ZeRO 1/2, buffers) is not here: at recovery it
    comes from a live replica.
    """

    def __init__(self, engine, data_state=None, load_data_state=None, spare: bool = False):
        self.engine = engine
        self.data_state = data_state
        self.load_data_state = load_data_state
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

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = [(f"fp32.{i}", p) for i, p in enumerate(fp32_partitions(self.engine))]
        named += [(f"optim.{n}", t.reshape(-1)) for n, t in optimizer_state_tensors(self.engine)]
        # Each rank's own buffers (a running statistic is computed from the rank's own data), and
        # under ZeRO 3 its partitions of frozen parameters (no other rank holds them).
        named += [(f"buffer.{name}", module._buffers[attr].reshape(-1)) for name, module, attr in self._buffers]
        named += [(f"frozen.{name}", p.ds_tensor.reshape(-1)) for name, p in self._frozen_partitions]
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
            "param_groups": [{k: jsonable(v) for k, v in g.items() if k != "params"} for g in inner.param_groups],
            # Plain values of the per-partition state: FusedAdam's and CPU Adam's ``step`` is an int.
            "optim_plain": plain_state(inner, fp32_partitions(e)),
            # The rest of the two generators' states (their words are tensors, above).
            "rng_python": {"version": py_state[0], "gauss_next": py_state[2]},
            "rng_numpy": dict(zip(("kind", "pos", "has_gauss", "cached_gaussian"),
                                  jsonable([np_state[i] for i in (0, 2, 3, 4)]))),
        }
        if e.lr_scheduler is not None:
            meta["lr_scheduler"] = jsonable(e.lr_scheduler.state_dict())
        scaler = getattr(e.optimizer, "loss_scaler", None)
        if scaler is not None:
            meta["loss_scaler"] = {k: jsonable(getattr(scaler, k)) for k in SCALER_FIELDS if hasattr(scaler, k)}
        if self.data_state is not None:
            meta["data"] = jsonable(self.data_state())
        return meta

    def restore(self, buf: torch.Tensor, layout: Layout, tensors_from: torch.Tensor | None = None) -> None:
        """Put the state of snapshot ``buf`` (laid out as ``layout``) back into the engine, in place.
        ``tensors_from``: the same snapshot on the device (the keeper's device copy), read for every
        tensor but the RNG states.

        Tensors are copied into the live fp32 partitions and optimizer state (so every alias
        DeepSpeed holds sees them); counters, param groups, scheduler, loss scaler, RNG states
        and the data position come from the metadata. :meth:`resync` must follow.
        """
        self._conform(layout)
        views = {seg.name: v for seg, v in zip(layout.segments, layout.views(buf))}
        meta = read_meta(buf, layout)
        source = views if tensors_from is None else dict(zip(views, layout.views(tensors_from)))
        if self._native is not None:
            self._native.prepare()
        with torch.no_grad():  # the fp32 partitions are leaves that require grad
            for name, live in self.tensors():
                if not name.startswith("rng."):
                    live.copy_(source[name])
        self._apply(meta, views)

    def extras(self) -> dict:
        """What a DeepSpeed checkpoint lacks for a bitwise resume: the metadata and the RNG states."""
        return {"meta": self.meta(), "rng": {n: t.clone() for n, t in self.tensors() if n.startswith("rng.")}}

    def load_checkpoint(self, directory: str, tag: str) -> None:
        """Load a checkpoint saved by :meth:`Session.save_checkpoint` into the engine, in place, with
        the bit16 weights re-derived (collective: every rank)."""
        self._clear_interrupted_step()
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
        self._apply(extras["meta"], extras["rng"])
        self._replicas_valid = True  # DeepSpeed loaded the module's frozen parameters from the files
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
            _clear_partition_grads(opt.single_partition_of_fp32_groups, getattr(opt, "cpu_offload", False))
        else:
            _reset_zero3(e, opt)

    def bytes_per_param(self) -> float:
        """Unique bytes this rank mirrors per model parameter (all ranks together)."""
        nbytes = sum(t.numel() * t.element_size() for _, t in self.tensors())
        world = dist.get_world_size() if dist.is_initialized() else 1
        num_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.engine.module.parameters())
        return nbytes * world / max(1, num_params)


def _clear_partition_grads(parts, offload: bool) -> None:
    """The interrupted step's gradients of the fp32 partitions. ZeRO-Offload keeps each
    partition's gradient buffer for the whole run (its backward copies into it): zeroed, not
    dropped."""
    for part in parts:
        if offload and part.grad is not None:
            part.grad.zero_()
        else:
            part.grad = None


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
    _clear_partition_grads(opt.fp32_partitioned_groups_flat, getattr(opt, "offload_optimizer", False))
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
