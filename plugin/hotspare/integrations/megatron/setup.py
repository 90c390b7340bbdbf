"""``initialize`` on megatron-core: the job's process group, ``parallel_state`` (made by hotspare,
so that it can make it again at a recovery), the caller's build, and the two set-up mistakes a
megatron-core example leads to, named; a spare's warm-up and its build on torch's fake group."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping

import torch

from ... import identity
from ...config import DEEPSPEED_SECTION, ConfigError, HotspareConfig, from_mapping, load_json_file, to_mapping
from ...position import data_hooks
from ...startup import goodbye_on_error, import_modules
from ..base import begin, enter, import_host, is_off, require_version
from .session import MegatronSession, fence_optimizer_step, parallel_state_groups, warm_up_checkpoint_writer
from .state import MegatronState, distributed_optimizers

SUPPORTED_MEGATRON = ("0.16.",)


def check_version() -> str:
    package_info = import_host("megatron.core.package_info", "megatron")
    return require_version("megatron-core", package_info.__version__, SUPPORTED_MEGATRON, "megatron-core>=0.16,<0.17")


@contextlib.contextmanager
def _gloo_twins_fake_on_a_spare(spare: bool):
    """A spare builds its rank's objects on torch's fake process group (startup.await_takeover),
    where torch cannot make a gloo group: megatron-core's gloo twins of the data-parallel groups
    (``create_gloo_process_groups``) are made there as fake groups too. The takeover's rebuild
    makes the real ones and re-points them by name, as every other group."""
    if not spare:
        yield
        return
    from megatron.core import parallel_state as ps

    original = ps.create_group

    def create_group(*args, backend=None, **kwargs):
        return original(*args, backend=None if backend == "gloo" else backend, **kwargs)

    ps.create_group = create_group
    try:
        yield
    finally:
        ps.create_group = original


def parse_config(config: Mapping | HotspareConfig | str | None) -> HotspareConfig | None:
    """The ``"hotspare"`` section: a mapping (the section, or a dict holding it under
    ``"hotspare"``), a JSON file path, or a HotspareConfig; None turns hotspare off."""
    if config is None or isinstance(config, HotspareConfig):
        return config
    if isinstance(config, str):
        config = load_json_file(config, "hotspare config")
    if not isinstance(config, Mapping):
        raise ConfigError(f"the hotspare config must be a mapping, a JSON path or a HotspareConfig, got "
                          f"{type(config).__name__}")
    section = config.get(DEEPSPEED_SECTION, config)
    return from_mapping(HotspareConfig, section, prefix=DEEPSPEED_SECTION)


# What a training script's build and loop import from megatron-core, often lazily (inside the
# build function): a spare imports them while it waits, so that the build after its order does
# not. On CPU here, the first build after a bare ``import megatron.core`` took 52-54 ms, 50 of
# them importing ``megatron.core.models.gpt`` (its activations register torch.compile'd
# functions); with these imported first it took 6 ms (tests/test_megatron_session.py pins that they
# exist).
LAZY_IMPORTS = (
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer",
    "megatron.core.distributed",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel",
)


def warm_up_spare() -> list[str]:
    """A spare, before it says it is ready: import :data:`LAZY_IMPORTS` (needs no rank, group or
    device). Returns the modules that did not import (a megatron-core that moved them: the
    build then imports what it needs itself)."""
    return import_modules(LAZY_IMPORTS)


def _use_local_device(backend: str) -> None:
    """With NCCL, make this rank's GPU (``LOCAL_RANK``) current: megatron-core builds its model,
    RNG tracker and buffers on the current device, and the mirror's stream and the keeper's
    device tier follow it. DeepSpeed's engine does this itself; without it every rank of a node
    would run on GPU 0 (and a spare could not choose its device before ``initialize``: the
    launcher gives it ``LOCAL_RANK`` only once it takes a rank). With gloo (more ranks than
    GPUs, say) the device is left as it is."""
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def build_checked(build: Callable[[], tuple], parallel: dict, enabled: bool) -> tuple:
    """``build()``, with the two set-up mistakes a megatron-core example leads to named."""
    try:
        model, optimizer, scheduler = build()
    except AssertionError as exc:
        text = str(exc)
        if ("not initialized" in text and ("gloo" in text or "partial data parallel" in text)
                and not parallel.get("create_gloo_process_groups")):
            raise ConfigError(
                f"the build asked for megatron-core's gloo process groups ({exc}): get_megatron_optimizer makes "
                f"them its default (use_gloo_process_groups=True), and hotspare's initialize creates them only when "
                f"told. Pass use_gloo_process_groups=False to get_megatron_optimizer (the distributed optimizer "
                f"needs none), or create_gloo_process_groups=True to hotspare.integrations.megatron.initialize "
                f"(four more groups rebuilt at each recovery)") from exc
        raise
    if enabled:
        check_optimizer(optimizer)
    return model, optimizer, scheduler


def check_optimizer(optimizer) -> None:
    """hotspare's megatron integration mirrors each rank's shard of megatron-core's distributed
    optimizer; any other optimizer is refused here with what to use instead."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    wrong = [o for o in distributed_optimizers(optimizer) if not isinstance(o, DistributedOptimizer)]
    if wrong:
        names = ", ".join(sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in wrong}))
        raise ConfigError(
            f"the build returned the optimizer {names}; hotspare's megatron integration supports megatron-core's "
            f"distributed optimizer only (each rank's unique state is its shard of it). Build it with "
            f"megatron.core.optimizer.get_megatron_optimizer(OptimizerConfig(..., use_distributed_optimizer=True), "
            f"model_chunks, use_gloo_process_groups=False)")


def initialize(build: Callable[[], tuple], config: Mapping | HotspareConfig | str | None, *,
               tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1, data_state=None,
               load_data_state=None, backend: str | None = None, **parallel) -> MegatronSession:
    """Join the job's process group (through ``hotspare-run``'s control store), initialise
    ``parallel_state`` and build this rank's objects with ``build()`` -> ``(model_chunks,
    optimizer, scheduler)``: megatron-core DDP chunks, ``get_megatron_optimizer``'s optimizer
    with the distributed optimizer (each rank's unique state is its shard), and an
    ``OptimizerParamScheduler`` or None.

    ``build`` runs after ``parallel_state`` is set up, so it sees this rank's stage; a spare
    (``HOTSPARE_ROLE=spare``) runs it for the rank it takes, while the coordinator plans, and
    returns a session restored to the landing iteration. The remaining keyword arguments go to
    ``initialize_model_parallel`` (which hotspare calls, and calls again at each recovery);
    its gloo twins of the data-parallel groups are made only with
    ``create_gloo_process_groups=True`` (megatron-core's default is True; here it is False:
    four fewer groups to make again at each recovery; pass it, and ``use_gloo_process_groups=True``
    to ``get_megatron_optimizer``, where the optimizer needs them), and its groups get
    ``recovery.collective_timeout_s``. On CPU apply
    ``hotspare_patches.megatron_core_cpu`` first.
    """
    check_version()
    from megatron.core import parallel_state as ps

    hs = parse_config(config)
    data_state, load_data_state, data_said = data_hooks(data_state, load_data_state)
    if ps.model_parallel_is_initialized():
        raise RuntimeError("parallel_state is initialised already: let hotspare's initialize call "
                           "initialize_model_parallel (pass its arguments here), so that it can rebuild the groups")
    warm_up = warm_up_checkpoint_writer() if hs is not None and hs.enabled and hs.checkpoint.enabled else None
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout_s = hs.recovery.collective_timeout_s if hs is not None else 120.0
    parallel = {"tensor_model_parallel_size": tensor_model_parallel_size,
                "pipeline_model_parallel_size": pipeline_model_parallel_size, "create_gloo_process_groups": False,
                **parallel, "distributed_timeout_minutes": timeout_s / 60.0}
    from megatron.core import package_info

    fp = identity.fingerprint({"parallel": parallel, "hotspare": to_mapping(hs) if hs else None},
                              {"megatron-core": package_info.__version__})
    # The rank's device before the build (a spare's, once await_takeover set LOCAL_RANK), and
    # before the NCCL group and the model exist.
    entry = enter(hs, backend, timeout_s, fp, warm_up_spare, on_device=lambda: _use_local_device(backend))
    gen = entry.generation
    with goodbye_on_error(entry.heartbeat):
        with _gloo_twins_fake_on_a_spare(entry.spare):
            ps.initialize_model_parallel(**parallel)
        model, optimizer, scheduler = build_checked(build, parallel, hs is not None and hs.enabled)
    model = list(model) if isinstance(model, (list, tuple)) else [model]
    session = MegatronSession(model=model, optimizer=optimizer, scheduler=scheduler, parallel=parallel, config=hs,
                              generation=gen, store=entry.store, heartbeat=entry.heartbeat, spare=entry.spare,
                              backend=backend, pin_memory=torch.cuda.is_available(), checkpoint_warm_up=warm_up,
                              ps_groups=parallel_state_groups())
    session.state = MegatronState(model, optimizer, scheduler, data_state, load_data_state)
    fence_optimizer_step(session)
    if is_off(hs, gen.rank, "the config given to initialize"):
        return session
    begin(session, data_said, "cuda" if torch.cuda.is_available() else "cpu")
    session.start(entry.order)
    return session
