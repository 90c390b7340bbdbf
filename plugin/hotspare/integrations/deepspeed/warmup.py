"""A DeepSpeed spare's warm-up: what its engine build would do after its order that needs no
rank or group, done while it waits (the lazy imports, the op probe, the optimizer's op)."""
from __future__ import annotations

from ...startup import import_modules


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
