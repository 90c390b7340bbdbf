"""Generations: one incarnation of the process groups, rendezvoused through the control store.

The control store (a TCPStore) is owned by the launcher, not by rank 0, so it outlives any
worker. Every generation g uses its own ``PrefixStore("gen/<g>/...")``, so keys of an older
generation never satisfy a newer rendezvous and stragglers of g are ignored by g+1.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch.distributed as dist

from . import control, env, faults, identity


@dataclass(frozen=True)
class Generation:
    """The identity of one process-group incarnation as seen by one process."""

    index: int
    """Generation number; 0 at job start, +1 for every rebuild."""
    rank: int
    """This process's active rank in the generation."""
    world_size: int
    """Number of active ranks."""

    @property
    def prefix(self) -> str:
        return f"gen/{self.index}/"


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client connection to the launcher's control store; a clear error when it cannot be reached."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as exc:  # torch raises DistNetworkError (a RuntimeError) or TimeoutError
        raise ConnectionError(
            f"cannot reach hotspare's control store at {host}:{port} within {timeout_s:.0f} s ({exc}). Is node 0's "
            f"hotspare-run up, and are --master-addr/--master-port (or --rdzv-endpoint) the address it listens "
            f"on? It listens on its --master-addr only.") from None


def store_from_env() -> dist.TCPStore:
    """Connect to the control store named by the launcher's environment."""
    host = os.environ.get(env.HOTSPARE_STORE_HOST) or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = env.env_int(env.HOTSPARE_STORE_PORT, env.env_int("MASTER_PORT", 0) or None)
    return connect_store(host, port, float(os.environ.get(env.HOTSPARE_STORE_TIMEOUT_S, "60")))




class Superseded(RuntimeError):
    """A newer plan exists: a member failed while this generation formed; join ``generation``."""

    def __init__(self, old: int, generation: int):
        super().__init__(f"generation {old} was superseded by generation {generation} before it formed "
                         f"(a member failed while joining)")
        self.generation = generation


def arrive(store: dist.Store, gen: Generation, timeout_s: float) -> None:
    """Wait until every member of ``gen`` has arrived (polled from Python; see :func:`join`).

    Raises :class:`Superseded` when the coordinator's plan for the next generation appears
    first: a member died before it arrived, and waiting for it would wait for the timeout.
    """
    store.set(f"{gen.prefix}arrived/{gen.rank}", "1")
    keys = [f"{gen.prefix}arrived/{r}" for r in range(gen.world_size)]
    newer = f"plan/{gen.index + 1}"
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if store.check([newer]):
            raise Superseded(gen.index, gen.index + 1)
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise TimeoutError(f"generation {gen.index}: rank(s) {missing} did not arrive within {timeout_s:.0f} s "
                               f"(a spare still building its engine, or a worker that died while joining)")
        time.sleep(control.RECOVERY_POLL_S)


def join(store: dist.Store, gen: Generation, backend: str, timeout_s: float,
         rendezvous_timeout_s: float | None = None, marks: dict | None = None) -> None:
    """Initialise the default process group for ``gen`` on its own prefix of ``store``.

    Members first meet in :func:`arrive`, a Python-level poll: the process-group constructor
    waits for its peers inside C++ without releasing the GIL, which would silence this
    worker's heartbeat thread for as long as the slowest member takes (a spare still building
    its engine) and get a healthy worker killed as hung. ``marks["arrived"]``, when given, is
    set to the moment every member had arrived.
    """
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists; call leave() before joining a new generation")
    faults.hit("join", gen.index)
    identity.check_job(store)
    arrive(store, gen, timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s)
    if marks is not None:
        marks["arrived"] = time.monotonic()  # every member is here: the rest is the group's own setup
    dist.init_process_group(backend, store=dist.PrefixStore(gen.prefix, store), rank=gen.rank,
                            world_size=gen.world_size, timeout=datetime.timedelta(seconds=timeout_s))


def leave() -> None:
    """Destroy every process group of the current generation (a no-op when none exists)."""
    if dist.is_initialized():
        dist.destroy_process_group()
