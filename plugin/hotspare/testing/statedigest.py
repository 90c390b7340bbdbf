"""A digest of a rank's whole training state, read from the host framework's own view.

The bitwise checks of the tests compare these between a recovered run and an uninterrupted
one. They are written from what DeepSpeed and torch expose (``state_dict()``s, the engine's
counters, the RNG getters), never from hotspare's capture code, so an entry hotspare fails to
capture is not also missed by the check (a lesson: the old check used the capture's own
tensor list and missed DeepSpeed's integer ``step``).
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def feed(h, value) -> None:
    """Hash ``value`` (tensors by dtype, shape and bytes; containers in order; the rest by repr)."""
    if torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        h.update(f"N{value.dtype}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            feed(h, v)
        h.update(b"]")
    else:
        h.update(f"{type(value).__name__}:{value!r}".encode())


def of(value) -> str:
    h = hashlib.sha256()
    feed(h, value)
    return h.hexdigest()


def rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def module_state(module: torch.nn.Module) -> dict:
    """Every parameter and buffer as this rank holds it: ZeRO 3's partition (``ds_tensor``) where a
    parameter is partitioned, else the tensor itself."""
    out = {}
    for name, p in module.named_parameters():
        out["param." + name] = p.ds_tensor if hasattr(p, "ds_tensor") else p
    for name, b in module.named_buffers():
        out["buffer." + name] = b
    return out


def deepspeed_engine(engine) -> dict[str, str]:
    """One digest per part of a DeepSpeed engine's state on this rank (local; no collective)."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    stage = engine.zero_optimization_stage()
    if stage == 3:  # ZeRO 3 puts its partitions into the inner optimizer's groups only for a step
        opt._set_fp32_optimizer_param_groups()
    try:
        inner_sd = inner.state_dict()
    finally:
        if stage == 3:
            opt._clear_fp32_optimizer_param_groups()
    parts = {
        "module": of(module_state(engine.module)),
        "optimizer.state": of(inner_sd["state"]),
        "optimizer.param_groups": of([{k: v for k, v in g.items() if k != "params"} for g in inner_sd["param_groups"]]),
        "counters": of({k: getattr(engine, k) for k in ENGINE_COUNTERS}),
        "rng": of(rng_states()),
    }
    if stage in (1, 2):
        parts["fp32"] = of(list(opt.single_partition_of_fp32_groups))
    elif stage == 3:
        parts["fp32"] = of(list(opt.fp32_partitioned_groups_flat))
    if engine.lr_scheduler is not None:
        parts["lr_scheduler"] = of(engine.lr_scheduler.state_dict())
    scaler = getattr(opt, "loss_scaler", None)
    if scaler is not None:
        parts["loss_scaler"] = of({k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))})
    return parts


def megatron(model: list, optimizer, scheduler=None) -> dict[str, str]:
    """One digest per part of a megatron-core rank's state (local; no collective): the model
    chunks' parameters and buffers, each ``DistributedOptimizer``'s fp32 shards, its inner torch
    optimizer's ``state_dict()`` (every state entry, ``step`` included, and every param-group
    entry) and grad scaler, the scheduler's ``state_dict()``, and the RNG states with megatron's
    tracker's. Read through megatron-core's own attributes, not hotspare's capture."""
    from megatron.core.tensor_parallel import random as mrandom

    inner = getattr(optimizer, "chained_optimizers", None)
    dos = list(inner) if inner is not None else [optimizer]
    parts = {"module": of([module_state(chunk) for chunk in model])}
    for i, do in enumerate(dos):
        sd = do.optimizer.state_dict()
        parts[f"optimizer{i}.state"] = of(sd["state"])
        parts[f"optimizer{i}.param_groups"] = of([{k: v for k, v in g.items() if k != "params"}
                                                   for g in sd["param_groups"]])
        parts[f"optimizer{i}.fp32"] = of([list(g) for g in do.shard_fp32_groups]
                                         + [list(g) for g in do.shard_fp32_from_float16_groups])
        if getattr(do, "grad_scaler", None) is not None:
            parts[f"optimizer{i}.grad_scaler"] = of(do.grad_scaler.state_dict())
    if scheduler is not None:
        parts["scheduler"] = of(scheduler.state_dict())
    parts["rng"] = of({**rng_states(), "tracker": mrandom.get_cuda_rng_tracker().get_states()})
    return parts


def differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The parts whose digests differ (or that only one side has)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
