"""Generations: one incarnation of the process groups, rendezvoused through the control store.

The control store (a TCPStore) is owned by the launcher, not by rank 0, so it outlives any
worker. Every generation g uses its own ``PrefixStore("gen/<g>/...")``, so keys of an older
generation never satisfy a newer rendezvous and stragglers of g are ignored by g+1.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from . import control, env, faults, identity
from .errors import RecoverableError


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
        return control.keys.generation_prefix(self.index)


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




class Superseded(RecoverableError):
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
    store.set(control.keys.arrived(gen.index, gen.rank), "1")
    keys = [control.keys.arrived(gen.index, r) for r in range(gen.world_size)]
    # A next plan counts only signed by the job (a process not started by hotspare-run, with no
    # secret, has no coordinator: any plan key then does).
    plane = control.ControlStore(store) if os.environ.get(env.HOTSPARE_JOB_SECRET) else None
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if plane.superseded(gen.index) if plane is not None else store.check([control.keys.plan(gen.index + 1)]):
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


def leave(background: bool = False) -> Reaper | None:
    """Destroy every process group of the current generation (a no-op when none exists).

    With ``background`` (a recovery), the groups' objects are handed to a :class:`Reaper`, which
    is returned for the caller to start once the recovery is over: destroying a gloo group waits
    for its threads, about 10 ms each on CPU, and a recovery leaves a dozen or more behind
    (megatron-core's alone are 14). Left to themselves they die wherever the garbage collector
    happens to free the exception frames and old objects that still hold them: as a 100-140 ms
    stall in the first iteration after the recovery, measured on the replayed iteration of
    ``recipes/bench_recovery.py framework=megatron``. The reaper's references keep them out of
    the collector's hands until then; the destructor releases the GIL, so training goes on
    while they are destroyed.
    """
    if not dist.is_initialized():
        return None
    # Every group the generation made, the default one included (torch's registry of them).
    reaper = Reaper(list(dist.distributed_c10d._world.pg_map)) if background else None
    dist.destroy_process_group()
    return reaper


class Reaper(threading.Thread):
    """Releases a left generation's process groups, each once nothing else holds it.

    A group is released when this thread holds its last reference, so that its destructor runs
    here: the exception frames and objects of the old generation that still point at it are
    freed by the collector first. After ``wait_s`` the rest are let go wherever they are held
    (a caller's own reference to an old group keeps it alive as long as it wants).
    """

    POLL_S = 0.02

    def __init__(self, groups: list, wait_s: float = 60.0):
        super().__init__(name="hotspare-reaper", daemon=True)
        self._groups, self.wait_s = groups, wait_s
        self._done = threading.Event()
        self.destroyed = 0
        """Groups whose last reference this thread dropped."""
        self.left = 0
        """Groups still held elsewhere when ``wait_s`` ran out."""

    def run(self) -> None:
        deadline = time.monotonic() + self.wait_s
        groups = self._groups
        while groups:
            for i in reversed(range(len(groups))):
                if sys.getrefcount(groups[i]) <= 2:  # the list's and the call's own
                    del groups[i]  # the destructor runs here
                    self.destroyed += 1
            if not groups or time.monotonic() > deadline or self._done.wait(self.POLL_S):
                break
        self.left = len(groups)
        groups.clear()

    def finish(self, timeout_s: float = 10.0) -> bool:
        """Stop waiting (the groups still held elsewhere are let go now) and join; True once ended.
        A reaper never started lets its groups go here."""
        self._done.set()
        if self.ident is None:
            self.left = len(self._groups)
            self._groups.clear()
            return True
        self.join(timeout_s)
        return not self.is_alive()
