"""What both host integrations share; ``integrations/deepspeed`` and ``integrations/megatron``
hold only what differs.

- :class:`HostState`: the state protocol the mirror, the keeper and the restore use (``tensors``,
  ``meta``, ``restore``, ``resync``, ``layout_for``, ``extras``), with the capture and restore of
  the RNG states every host has (torch's, the accelerator's, Python's and NumPy's) and the
  layout handling (a snapshot of version 0 has no optimizer state, every later one has);
- the start-up sequence: :func:`enter` (a spare waits for its order, an active rank joins the
  first generation), :func:`begin` (events, keeper), and :func:`require_version`.

A host's state names its tensors; the names ``rng.*`` are the RNG states (restored from the
host copy of a snapshot, never from its device copy) and ``optim.*`` the optimizer state (absent
at version 0).
"""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config import HotspareConfig
from ..errors import FatalError
from ..events import EventLog, log
from ..generation import Generation
from ..position import NO_DATA_HOOKS
from ..recovery import RecoveryError
from ..snapshot import Layout, read_meta
from ..startup import Takeover, await_takeover, heartbeat_for, join_from_env, keeper_for
from ..worker import Heartbeat, role
from .optim_state import jsonable


class UnsupportedVersion(FatalError):
    """The host framework's installed version is not one whose internals hotspare's are pinned to."""


def require_version(package: str, installed: str, supported: tuple[str, ...], install: str) -> str:
    """``installed`` if it starts with one of ``supported``; else :class:`UnsupportedVersion`
    naming what to install."""
    if not installed.startswith(supported):
        raise UnsupportedVersion(f"hotspare supports {package} {', '.join(v + 'x' for v in supported)}; {installed} is "
                                 f"installed (its internals may differ): install {install}")
    return installed


def import_host(module: str, extra: str):
    """Import the host framework ``module``; where it is not installed, say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{module} is not installed ({exc}); install it with pip install 'hotspare[{extra}]'") from exc


class HostState:
    """One rank's unique state on a host (the razor: what no other rank holds).

    A host subclass gives its own tensors (:meth:`unique_tensors`), its metadata
    (:meth:`host_meta`, :meth:`apply_host_meta`), its device RNG states and its optimizer's
    state creation; this class adds the RNG states and the data position, and does the restore.
    """

    def __init__(self, data_state=None, load_data_state=None):
        self.data_state = data_state
        self.load_data_state = load_data_state

    # What a host gives.
    def unique_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the rank's unique tensors, in a fixed order (the layout's)."""
        raise NotImplementedError

    def device_rng_states(self) -> list[tuple[str, torch.Tensor]]:
        """(name ``rng.*``, state) of the accelerator's generators."""
        return []

    def set_device_rng_states(self, views: dict) -> None:
        """Put back what :meth:`device_rng_states` captured (``views``: name -> tensor)."""

    def host_meta(self) -> dict:
        """The host's counters, schedulers and hyper-parameters (JSON)."""
        return {}

    def apply_host_meta(self, meta: dict, views: dict) -> None:
        """Put :meth:`host_meta`'s values back (after the RNG states)."""

    def has_optimizer_state(self) -> bool:
        raise NotImplementedError

    def set_optimizer_state(self, present: bool) -> None:
        """Create (with the optimizer's own shapes and dtypes; values to be overwritten) or drop
        the optimizer's per-parameter state."""
        raise NotImplementedError

    def before_restore(self) -> None:
        """Called before the tensors of a restore are copied in."""

    # The protocol.
    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = self.unique_tensors()
        named.append(("rng.torch", torch.get_rng_state()))
        named += self.device_rng_states()
        # The Mersenne-Twister words of Python's and NumPy's generators travel as tensors: as
        # JSON they were most of the metadata's bytes and of its per-step encoding time.
        named.append(("rng.python", torch.tensor(random.getstate()[1], dtype=torch.int64)))
        named.append(("rng.numpy", torch.from_numpy(np.random.get_state()[1].astype(np.int64))))
        return named

    def meta(self) -> dict:
        py, nps = random.getstate(), np.random.get_state()  # each read once: this runs every step
        meta = self.host_meta()
        # The rest of the two generators' states (their words are tensors, above).
        meta["rng_python"] = {"version": py[0], "gauss_next": py[2]}
        meta["rng_numpy"] = dict(zip(("kind", "pos", "has_gauss", "cached_gaussian"),
                                     jsonable([nps[i] for i in (0, 2, 3, 4)])))
        if self.data_state is not None:
            meta["data"] = jsonable(self.data_state())
        return meta

    def restore(self, buf: torch.Tensor, layout: Layout, tensors_from: torch.Tensor | None = None) -> None:
        """Put the state of snapshot ``buf`` (laid out as ``layout``) back, in place (every alias
        the host holds sees it). ``tensors_from``: the same snapshot on the device (the keeper's
        device copy), read for every tensor but the RNG states. :meth:`resync` must follow."""
        self.conform(layout)
        views = {seg.name: v for seg, v in zip(layout.segments, layout.views(buf))}
        meta = read_meta(buf, layout)
        source = views if tensors_from is None else dict(zip(views, layout.views(tensors_from)))
        self.before_restore()
        with torch.no_grad():  # master weights are leaves that require grad
            for name, live in self.tensors():
                if not name.startswith("rng."):
                    live.copy_(source[name])
        self.apply(meta, views)

    def apply(self, meta: dict, views: dict) -> None:
        """The RNG states, the host's metadata and the data position (``views``: the RNG tensors)."""
        torch.set_rng_state(views["rng.torch"].clone())
        self.set_device_rng_states(views)
        py, nps = meta["rng_python"], meta["rng_numpy"]
        random.setstate((py["version"], tuple(int(x) for x in views["rng.python"].tolist()), py["gauss_next"]))
        np.random.set_state((nps["kind"], views["rng.numpy"].numpy().astype(np.uint32), nps["pos"],
                             nps["has_gauss"], nps["cached_gaussian"]))
        self.apply_host_meta(meta, views)
        if "data" in meta and self.load_data_state is not None:
            self.load_data_state(meta["data"])

    def extras(self) -> dict:
        """What a host's checkpoint lacks for a bitwise resume: the metadata and the RNG states."""
        return {"meta": self.meta(), "rng": {n: t.clone() for n, t in self.tensors() if n.startswith("rng.")}}

    def load_extras(self, extras: dict) -> None:
        """Put :meth:`extras` back (after the checkpoint's tensors were loaded)."""
        self.apply(extras["meta"], extras["rng"])

    def layout_for(self, layout_id: int) -> Layout | None:
        """This rank's layout with id ``layout_id`` (with or without optimizer state), or None.

        A snapshot of version 0 has no optimizer state (torch's optimizers create it at their
        first step); every later one has. A rank that has not stepped yet (a spare) gets its
        optimizer state created (then overwritten by the restore) to take a later version.
        """
        layout = Layout.of(self.tensors())
        if layout.id == layout_id:
            return layout
        had = self.has_optimizer_state()
        self.set_optimizer_state(not had)
        other = Layout.of(self.tensors())
        if other.id == layout_id:
            return other
        self.set_optimizer_state(had)
        return None

    def conform(self, layout: Layout) -> None:
        """Create or drop the optimizer state as ``layout`` has it; refuse a layout that still differs."""
        wants = any(s.name.startswith("optim.") for s in layout.segments)
        if wants != self.has_optimizer_state():
            self.set_optimizer_state(wants)
        live = self.tensors()
        if not layout.matches(live):
            raise RecoveryError(f"the snapshot's layout ({layout.nbytes} bytes, {len(layout.segments)} tensors) is not "
                                f"this rank's ({Layout.of(live).nbytes} bytes, {len(live)} tensors): is every rank, "
                                f"spares included, running the same model and config?")

    def ensure_optimizer_state(self) -> None:
        """Create the optimizer state if the optimizer has not stepped yet (values to be overwritten)."""
        if not self.has_optimizer_state():
            self.set_optimizer_state(True)


def zero_gradient_step(inner: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """One step of ``inner`` at learning rate 0 with zero gradients for ``params``: creates its
    per-parameter state with the optimizer's own shapes and dtypes. Gradients and param groups
    are as they were after."""
    saved = [dict(g) for g in inner.param_groups]
    with warnings.catch_warnings():  # megatron-core's fp32 shards are views into DDP's buffer (not leaves)
        warnings.simplefilter("ignore", UserWarning)
        grads = [p.grad for p in params]
    for g in inner.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        inner.step()
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        for g, s in zip(inner.param_groups, saved):
            g.update(s)


@dataclass
class Entry:
    """How this process entered the job (:func:`enter`)."""

    generation: Generation
    store: Any
    heartbeat: Heartbeat | None
    order: Takeover | None
    """A spare's takeover order (None for an active rank)."""

    @property
    def spare(self) -> bool:
        return self.order is not None


def enter(hs: HotspareConfig | None, backend: str, timeout_s: float, fingerprint: str, warm_up,
          on_device=lambda: None) -> Entry:
    """A spare (``HOTSPARE_ROLE=spare``) warms up (``warm_up()``) and waits for its order; an
    active rank joins the first generation through hotspare-run's store, unless the caller
    initialised a process group already. ``on_device()`` runs once the rank (so ``LOCAL_RANK``)
    is known and before any group is made."""
    if role() == "spare":
        order = await_takeover(hs, warm_up, fingerprint)
        on_device()
        return Entry(Generation(order.generation - 1, order.rank, order.world_size), order.store, order.heartbeat,
                     order)
    if dist.is_initialized():
        return Entry(Generation(index=0, rank=dist.get_rank(), world_size=dist.get_world_size()), None, None, None)
    on_device()
    gen, store = join_from_env(backend, timeout_s, fingerprint)
    heartbeat = heartbeat_for(hs, store) if hs is not None and hs.enabled else None
    return Entry(gen, store, heartbeat, None)


def is_off(hs: HotspareConfig | None, rank: int, where: str) -> bool:
    """True when the config turns hotspare off (rank 0 says so, naming ``where`` the section is
    looked for, and how to turn it on)."""
    if hs is not None and hs.enabled:
        return False
    if rank == 0:
        why = 'no "hotspare" section' if hs is None else '"hotspare": {"enabled": false}'
        log(f"hotspare is off ({why} in {where}): no mirror, keeper or recovery; "
            f'"hotspare": {{}} turns it on with its defaults')
    return True


def begin(session, data_said: bool, device_name: str) -> None:
    """The session's event log and keeper client (before :meth:`Session.start`); rank 0 warns
    once when the loop gave no data hooks."""
    gen = session.generation
    session.events = EventLog(session.config.events_dir, gen.rank, gen.index)
    if not data_said and gen.rank == 0 and not session.spare:
        log(f"WARNING: {NO_DATA_HOOKS}")
    session.keeper = keeper_for(session.config, device_name)
