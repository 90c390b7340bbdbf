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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import env
from ..config import HotspareConfig, split_deepspeed_config
from ..generation import Generation, join, leave, store_from_env

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

    def close(self) -> None:
        """Leave the current generation; call once at the end of training."""
        leave()
        self.store = None


def _join_from_env(backend: str, timeout_s: float) -> tuple[Generation, Any]:
    gen = Generation(index=env.env_int(env.HOTSPARE_GENERATION, 0), rank=env.env_int("RANK"),
                     world_size=env.env_int("WORLD_SIZE"))
    store = store_from_env()
    join(store, gen, backend, timeout_s)
    return gen, store


def initialize(model: torch.nn.Module, config: dict | str, *, model_parameters=None, optimizer=None,
               lr_scheduler=None, training_data=None, collective_timeout_s: float = 120.0, **kwargs) -> Session:
    """``deepspeed.initialize`` with hotspare: validates the ``"hotspare"`` section first.

    The process group is joined through the launcher's control store (``hotspare-run``), on
    the generation's own store prefix, unless the caller already initialised one.
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
    return Session(engine=engine, optimizer=opt, training_dataloader=loader, lr_scheduler=sched,
                   config=hs_config, generation=gen, store=store)


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
