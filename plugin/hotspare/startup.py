"""How a process enters a hotspare job: an active rank joins the first generation, a spare
warms up and waits for its takeover order; and the per-process helpers both need (the
keeper client, the heartbeat, the default timeout of the host's groups, who is on which node).

The session (:mod:`hotspare.session`) takes over from here: failover in the training loop and
recovery.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import control, env, identity
from .config import ConfigError, HotspareConfig
from .events import log
from .generation import Generation, join, store_from_env
from .keeper_client import KeeperClient
from .worker import Heartbeat, Shutdown, wait_for_order, worker_id


def join_from_env(backend: str, timeout_s: float, fingerprint: str | None = None) -> tuple[Generation, Any]:
    """An active rank joins the job's first generation through hotspare-run's store, after its
    job id and ``fingerprint`` (:mod:`hotspare.identity`) are checked."""
    gen = Generation(index=env.env_int(env.HOTSPARE_GENERATION, 0), rank=env.env_int("RANK"),
                     world_size=env.env_int("WORLD_SIZE"))
    store = store_from_env()
    identity.check_job(store)
    if fingerprint is not None:
        identity.check_fingerprint(store, fingerprint, worker_id())
    join(store, gen, backend, timeout_s)
    return gen, store


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


@contextlib.contextmanager
def goodbye_on_error(heartbeat: Heartbeat | None):
    """Around a start-up step that may raise a user's error (a build, a config check): the worker
    says goodbye before the exception leaves, so that its launcher takes the exit that follows
    for an error, not for a hang (a gloo group's destructor at exit waits for its peers, seconds
    past the heartbeat's timeout, and the worker was killed as hung; seen with megatron's plain
    Adam refused on every rank)."""
    try:
        yield
    except BaseException:
        if heartbeat is not None:
            heartbeat.close()
        raise


def keeper_for(cfg: HotspareConfig, accelerator: str) -> KeeperClient | None:
    """This process's keeper client; ``accelerator``: DeepSpeed's accelerator name ('cuda', 'cpu', ...)."""
    if cfg.retain.device_tier and accelerator != "cuda":
        raise ConfigError(f"hotspare.retain.device_tier=true needs CUDA GPUs, and the accelerator here is "
                          f"{accelerator!r}: set it to false")
    if not (cfg.retain.keeper and cfg.mirror.enabled):
        return None
    path = os.environ.get(env.HOTSPARE_KEEPER_SOCKET)
    if not path:
        log("hotspare.retain.keeper is on, but no keeper runs for this process (start it with hotspare-run): "
             "its state is kept in its own memory and its peers' only")
        return None
    return KeeperClient(path, device_tier=cfg.retain.device_tier)


def heartbeat_for(cfg: HotspareConfig, store) -> Heartbeat | None:
    if store is None or not cfg.recovery.enabled:
        return None
    return Heartbeat(worker_id(), cfg.recovery.heartbeat_interval_s, cfg.recovery.heartbeat_timeout_s)


def wait_for_takeover(store: control.ControlStore, heartbeat, prepare: bool = False):
    try:
        return wait_for_order(store, worker_id(), prepare)
    except Shutdown:
        if heartbeat is not None:
            heartbeat.close()
        raise SystemExit(0) from None


@dataclass
class Takeover:
    """A spare's order: the rank it takes in ``generation`` (``plan`` is None while the coordinator
    is still planning: the spare builds its state meanwhile and waits for the plan after)."""

    store: Any
    heartbeat: Heartbeat | None
    plan: control.Plan | None
    rank: int
    world_size: int
    generation: int
    t_order: float


def await_takeover(cfg: HotspareConfig | None, warm_up: Callable[[], Any] = lambda: None,
                   fingerprint: str | None = None) -> Takeover:
    """A spare (``HOTSPARE_ROLE=spare``): warm up, wait for a takeover order, then stand in for
    the rank it names on torch's fake process group (collectives do nothing), so that the host
    builds that rank's objects while the coordinator plans; :func:`hotspare.session.landing.join_as_spare`
    then joins the survivors' real generation and re-points exactly as they do. Exits the
    process (status 0) when the job ends first."""
    if cfg is None or not cfg.enabled or not cfg.recovery.enabled:
        raise ConfigError("this process was started as a spare, but the config's \"hotspare\" section is "
                          "missing or has recovery off; give the job's config to every worker")
    store = store_from_env()
    # A spare started with another script, config or version is refused now, not at its takeover.
    identity.check_job(store)
    if fingerprint is not None:
        identity.check_fingerprint(store, fingerprint, worker_id())
    heartbeat = heartbeat_for(cfg, store)
    warm_up()
    # The coordinator names the rank as soon as the failure is reported (Prepare), so the
    # host's objects are built while it settles and plans; the order (the plan) follows.
    ctl = control.ControlStore(store)
    order = wait_for_takeover(ctl, heartbeat, prepare=True)
    t_order = time.monotonic()
    plan = None
    if isinstance(order, control.Prepare):
        rank, world, generation, replaces = order.rank, order.world_size, order.generation, order.replaces
    else:
        plan = order
        rank, world, generation = plan.rank_of(worker_id()), plan.world_size, plan.generation
        replaces = next((f["worker"] for f in plan.failures if f["rank"] == rank), "")
    if replaces and env.configure_accelerator() != "cpu":
        # The failure was reported when its process began to exit; its device memory is
        # released only when it is gone.
        ctl.wait(control.keys.exited(replaces), cfg.recovery.rendezvous_timeout_s,
                 f"the failed worker {replaces} to exit (its device is this spare's)")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    # The dead rank's device index on its node (free now that it died). On an accelerator the
    # coordinator gives a spare only its own node's ranks (it said so in ready/<wid>): another
    # node's devices all belong to live ranks.
    os.environ["LOCAL_RANK"] = str(rank % env.env_int("LOCAL_WORLD_SIZE", world))
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return Takeover(store, heartbeat, plan, rank, world, generation, t_order)


def import_modules(names) -> list[str]:
    """Import ``names`` (a spare's warm-up: what its host's build imports lazily); return those
    that did not import (a host version that moved them: the build then imports its own)."""
    import importlib

    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def gather_ints(value: int, group=None) -> list[int]:
    """Every rank's ``value``, by rank (one all-gather over ``group``, default: the default group)."""
    mine = torch.tensor([value], dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(t) for t in out]


def node_ranks(group=None) -> list[int]:
    """Every rank's (logical) node, gathered over ``group`` (default: the default group)."""
    return gather_ints(env.env_int(env.HOTSPARE_NODE_RANK, 0), group)
