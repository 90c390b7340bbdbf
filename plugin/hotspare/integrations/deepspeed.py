"""DeepSpeed integration: start-up through hotspare, and access to ZeRO's partitions.

Internals read here (pinned by tests/test_deepspeed_internals.py, which fail loudly on a
DeepSpeed upgrade that moves them):
- ZeRO 1/2 ``DeepSpeedZeroOptimizer.single_partition_of_fp32_groups[i]``: the flat fp32
  master partition of param group i; the inner optimizer's only parameter of that group.
- ZeRO 3 ``DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat[j]``: the flat fp32
  partition of sub-group j; the inner optimizer's parameters.
"""
from __future__ import annotations

import datetime
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import env
from ..config import ConfigError, HotspareConfig, split_deepspeed_config
from ..events import EventLog
from ..generation import Generation, join, leave, store_from_env
from ..mirror import Mirror
from ..placement import place
from ..transport import GlooTransport

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
    """What ``hotspare.initialize`` returns: the DeepSpeed objects plus hotspare's handles."""

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

    def close(self) -> None:
        """Stop mirroring and leave the current generation; call once at the end of training."""
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None
        if self.events is not None:
            self.events.close()
        for group in self.groups:
            dist.destroy_process_group(group)
        self.groups = ()
        leave()
        self.store = None


def _join_from_env(backend: str, timeout_s: float) -> tuple[Generation, Any]:
    gen = Generation(index=env.env_int(env.HOTSPARE_GENERATION, 0), rank=env.env_int("RANK"),
                     world_size=env.env_int("WORLD_SIZE"))
    store = store_from_env()
    join(store, gen, backend, timeout_s)
    return gen, store


def initialize(model: torch.nn.Module, config: dict | str, *, model_parameters=None, optimizer=None,
               lr_scheduler=None, training_data=None, collective_timeout_s: float = 120.0, data_state=None,
               **kwargs) -> Session:
    """``deepspeed.initialize`` with hotspare: validates the ``"hotspare"`` section first.

    The process group is joined through the launcher's control store (``hotspare-run``), on
    the generation's own store prefix, unless the caller already initialised one.
    ``data_state`` (optional) returns the data position as JSON-able values; it is mirrored.
    With mirroring on, ``engine.step()`` mirrors the unique state after every optimizer step.
    """
    ds_config, hs_config = split_deepspeed_config(config)
    env.configure_accelerator()
    import deepspeed

    check_version()
    from deepspeed.accelerator import get_accelerator

    store = None
    if dist.is_initialized():
        gen = Generation(index=0, rank=dist.get_rank(), world_size=dist.get_world_size())
    else:
        gen, store = _join_from_env(get_accelerator().communication_backend_name(), collective_timeout_s)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    engine, opt, loader, sched = deepspeed.initialize(
        model=model, config=ds_config, model_parameters=model_parameters, optimizer=optimizer,
        lr_scheduler=lr_scheduler, training_data=training_data, **kwargs)
    if engine.zero_optimization_stage() not in (1, 2, 3):
        raise ValueError(f"zero_optimization.stage={engine.zero_optimization_stage()}: hotspare needs ZeRO stage "
                         f"1, 2 or 3 (each rank's unique state is its ZeRO partition)")
    session = Session(engine=engine, optimizer=opt, training_dataloader=loader, lr_scheduler=sched,
                      config=hs_config, generation=gen, store=store)
    if hs_config is not None and hs_config.enabled:
        session.events = EventLog(hs_config.events_dir, gen.rank, gen.index)
        session.state = DeepSpeedState(engine, data_state)
        if hs_config.mirror.enabled and hs_config.mirror.replicas > 0 and gen.world_size > 1:
            _start_mirror(session, hs_config)
    return session


def node_ranks() -> list[int]:
    """Every rank's (logical) node, gathered as tensors over the default group."""
    mine = torch.tensor([env.env_int(env.HOTSPARE_NODE_RANK, 0)], dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [int(t) for t in out]


def _start_mirror(session: Session, cfg: HotspareConfig) -> None:
    gen, mc = session.generation, cfg.mirror
    nodes = node_ranks()
    try:
        holders = place(nodes, mc.replicas)
    except ValueError as exc:
        raise ConfigError(f"hotspare.mirror.replicas={mc.replicas}: {exc}") from None
    # Mirror bytes and the per-step agreement get groups of their own (host memory, gloo), so
    # they never queue behind the training collectives.
    timeout = datetime.timedelta(seconds=mc.timeout_s)
    data_group = dist.new_group(backend="gloo", timeout=timeout)
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    session.groups = (data_group, control_group)

    def agree(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group)

    from deepspeed.accelerator import get_accelerator

    pin = get_accelerator().device_name() != "cpu"
    session.mirror = Mirror(gen.rank, gen.index, holders, GlooTransport(data_group, gen.rank), agree,
                            in_flight=mc.in_flight, chunk_bytes=mc.chunk_bytes, timeout_s=mc.timeout_s,
                            pin_memory=pin, on_event=session.events)
    session.events("mirror_start", holders=holders[gen.rank], nodes=nodes,
                   single_node=len(set(nodes)) == 1)
    engine, state, mirror = session.engine, session.state, session.mirror
    step = engine.step

    # Wrap the one call every DeepSpeed loop makes: after an optimizer step (global_steps moved)
    # the post-step state is captured and its copy starts on the mirror thread.
    def step_and_mirror(*args, **kw):
        before = engine.global_steps
        out = step(*args, **kw)
        if engine.global_steps != before:
            mirror.on_step(engine.global_steps, state.tensors, state.meta)
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

    def __init__(self, engine, data_state=None):
        self.engine = engine
        self.data_state = data_state
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

    def bytes_per_param(self) -> float:
        """Unique bytes this rank mirrors per model parameter (all ranks together)."""
        nbytes = sum(t.numel() * t.element_size() for _, t in self.tensors())
        world = dist.get_world_size() if dist.is_initialized() else 1
        num_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.engine.module.parameters())
        return nbytes * world / max(1, num_params)


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
