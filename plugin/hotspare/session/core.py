"""A training process's hotspare session: its handles, the training-loop API (``steps``,
``resilient``, ``close``), the alarm that makes a step leave a failed generation at once, and
what each host framework says (the subclasses). How a process gets here (an active rank's join,
a spare's wait for its order) is :mod:`hotspare.startup`; what a recovery does is
:mod:`.landing`, where the restored state comes from :mod:`.sources`, how it is protected
again :mod:`.protection`.

:class:`Session` is subclassed per host framework
(:class:`hotspare.integrations.deepspeed.DeepSpeedSession`,
:class:`hotspare.integrations.megatron.MegatronSession`), which say where the step count and
the process-group handles are, how the host's groups are rebuilt in a new generation, and
what the unique state is (``state``: ``tensors``, ``meta``, ``restore``, ``resync``,
``layout_for``, ``load_checkpoint``).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from .. import control, env, rebuild
from ..alarm import AlarmGuard
from ..config import HotspareConfig
from ..events import EventLog, log
from ..generation import Generation, leave
from ..keeper_client import KeeperClient
from ..mirror import Mirror, MirrorError
from ..recovery import is_distributed_error
from ..setupguard import SetupGuard
from ..sockets import DRAIN_S, abort_nccl, break_connections
from ..worker import Heartbeat
from . import landing, protection, sources
from .handover import Handover
from .landing import CatchUp


@dataclass(kw_only=True)
class Session:
    """A training process's hotspare handles, and its failover (see the subclasses' docs for the
    training-loop API of each framework)."""

    config: HotspareConfig | None
    """The validated ``"hotspare"`` section, or None when the config has none (hotspare off)."""
    generation: Generation
    """The process-group generation this process is in."""
    store: Any
    """The control-store client (None when the process group was set up by the caller)."""
    mirror: Mirror | None = None
    """The peer mirror of this rank's unique state (None when mirroring is off)."""
    state: Any = None
    """What this rank mirrors (the host's unique-state object)."""
    events: EventLog | None = None
    """This rank's event log."""
    groups: tuple = ()
    """Process groups hotspare created (destroyed on close)."""
    heartbeat: Heartbeat | None = None
    """This worker's heartbeat to its launcher (None outside hotspare-run)."""
    recoveries: list = field(default_factory=list)
    """One summary dict per recovery this process took part in (phases and their seconds)."""
    spare: bool = False
    """This process started as a spare and took a failed rank's place."""
    checkpoints: Any = None
    """The background checkpoint engine (None when ``hotspare.checkpoint`` is off)."""
    backend: str = "gloo"
    pin_memory: bool = False
    """Mirror snapshots live in pinned host memory (an accelerator is in use)."""
    same_layout_everywhere: bool = True
    """Every rank's unique state has the same layout (ZeRO's equal partitions), so ranks agree on
    it before resuming; a pipeline's stages differ (each restore checks its own layout)."""
    keeper: KeeperClient | None = None
    """This node's keeper (None when retention is off or the process was not started by hotspare-run)."""
    catching_up: CatchUp | None = None
    """Rank 0 after a recovery that replaced a rank, until the new generation caught up."""
    handover: Handover | None = None
    """This worker's compute clock and handover flag (:mod:`.handover`; under hotspare-run)."""
    # The session package's own (landing, sources, protection):
    kept: Any = field(default=None, repr=False)
    """The retained segment of the rank this spare took (read by its restore), and its verified versions."""
    retired_mirrors: list = field(default_factory=list, repr=False)
    """Mirrors of failed generations whose thread may still be inside a transfer (joined at close)."""
    reapers: list = field(default_factory=list, repr=False)
    """The threads releasing the groups of generations left behind (:func:`leave`)."""
    setup_guard: SetupGuard | None = field(default=None, repr=False)
    """On a spare, from its takeover to its loop's first step: collectives of the script's set-up
    (setupguard.py)."""
    _control: Any = field(default=None, repr=False)
    _trained: bool = False

    @property
    def control(self) -> "control.ControlStore | None":
        """The control plane's operations on ``store``, signed with the job's secret (None without
        a store)."""
        if self.store is None:
            return None
        if self._control is None or self._control.raw is not self.store:
            self._control = control.ControlStore(self.store)
        return self._control

    def __post_init__(self) -> None:
        self.alarm = AlarmGuard(self._leave_alarmed)
        self._interrupts = []
        if self.heartbeat is not None:
            # A forward under way raises once the generation failed (see _check_alarm).
            self._interrupts = [m.register_forward_pre_hook(self._check_alarm) for m in self.interruptible()]
        if self.heartbeat is not None and not self.spare:
            self.heartbeat.watch(self.generation.index, functools.partial(self.alarm.superseded, self.generation.index))

    def interruptible(self) -> list:
        """The modules whose forward checks for the coordinator's alarm: where a step computes
        for a while with no collective that the broken connections would make raise (DeepSpeed
        ZeRO 1/2's forward). None by default."""
        return []

    def _check_alarm(self, module, args) -> None:
        """A forward pre-hook: the step leaves for the recovery once the generation failed."""
        self.alarm.raise_if_alarmed(self.generation.index)

    def _leave_alarmed(self, generation: int) -> None:
        """The coordinator said that ``generation`` failed (its alarm, or the next generation's
        plan) while this worker still trains in it (alarm.py): whatever collective the training
        thread waits in raises now, and the next one at once, instead of at its timeout."""
        log(f"rank {self.generation.rank}: the coordinator says generation {generation} failed; leaving it now")
        if self.backend != "gloo":
            try:  # (a walk of the host's objects: for NCCL's communicators only)
                abort_nccl([r.group for r in self.host_groups()])
            except Exception:  # noqa: BLE001 - best effort from another thread; the sockets are next
                pass
        self.break_connections()

    def break_connections(self) -> int:
        """Shut down every connection but the control store's (sockets.py); returns how many.
        One still moving a payload when the drain ran out is said: its collective, here and on
        the peer, waits out the group's timeout (gloo wakes neither end)."""
        broken = break_connections({env.env_int(env.HOTSPARE_STORE_PORT, 0)})
        if broken.forced:
            timeout = self.config.recovery.collective_timeout_s if self.config is not None else 0.0
            log(f"rank {self.generation.rank}: {broken.forced} connection(s) still carried a payload after "
                f"{DRAIN_S:g} s and were cut; a collective moving it leaves only at its timeout "
                f"(recovery.collective_timeout_s={timeout:g})")
            self.events("cut_mid_payload", connections=broken.forced)
        return broken.count

    # ---- the training-loop API ---------------------------------------------------------------

    def step_count(self) -> int:
        """Optimizer steps taken (the version the state is at)."""
        raise NotImplementedError

    def steps(self, total: int):
        """Step indices from where the state is (:meth:`step_count`) up to ``total``.

        After a recovery the next index is the landing version's, so the interrupted step and
        any a survivor had run past it are run again, with the same batches.
        """
        self._end_setup()
        while self.step_count() < total:
            yield self.step_count()
            if self.catching_up is not None:
                self._note_caught_up()
        if self.handover is not None:
            self.handover.disarm()

    def resilient(self, fn: Callable) -> Callable:
        """Decorate the function that runs one training step (all its micro-batches).

        A failure of a peer inside it (a collective that raises, a broken mirror) is recovered
        in place: a spare takes the failed rank, the state lands on the newest version every
        rank holds, and the call returns None; ``steps`` then resumes from there. An exception
        that is not a distributed failure (a bug) is re-raised at once.
        """
        @functools.wraps(fn)
        def run(*args, **kwargs):
            self._end_setup()
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - classified below
                if not self._can_recover(exc):
                    raise
                self.recover(exc)
                return None
            if self.catching_up is not None:
                self._note_caught_up()
            return result

        return run

    def _note_caught_up(self) -> None:
        """Called after each call of the ``resilient`` function and each step ``steps`` counted:
        a call that completed no step (another function made resilient) does not count."""
        generation = self.catching_up.generation
        if not self.catching_up.reached(self.step_count()):
            return  # no step completed in this generation yet, or still replaying
        self.catching_up = None
        try:
            self.control.set_caught_up(generation, self.step_count())
        except Exception as exc:  # noqa: BLE001 - the launchers start the successors at their bound
            log(f"rank 0: could not tell the launchers that generation {generation} caught up ({exc}); "
                f"they start the successor spares after --successor-wait-s")

    def _can_recover(self, exc: BaseException) -> bool:
        cfg = self.config
        return (cfg is not None and cfg.enabled and cfg.recovery.enabled and self.store is not None
                and is_distributed_error(exc))

    def recover(self, error: BaseException) -> None:
        """A survivor's recovery after ``error``: rebuild in place with the coordinator's plan
        (:func:`.landing.recover`)."""
        if self.handover is not None:
            self.handover.interrupted()
        landing.recover(self, error)

    def start(self, order=None) -> None:
        """The end of ``initialize``, once the host objects and ``state`` exist: an active rank
        starts protecting its state; a spare (``order``: its :class:`~hotspare.startup.Takeover`)
        joins the survivors' generation and lands with them."""
        if self.heartbeat is not None:
            self.handover = Handover(self, self.compute_modules(), self.uncomputable(), self.step_entry())
        if self.spare:
            landing.join_as_spare(self, order.plan, order.rank, order.t_order)
        elif self.generation.world_size > 1:
            protection.protect(self)

    def reap(self, reaper) -> None:
        """Keep a left generation's groups until the recovery is over (:meth:`release_left_groups`)."""
        if reaper is not None:
            self.reapers.append(reaper)

    def release_left_groups(self) -> None:
        """Training resumes: the groups of the generations left behind are destroyed meanwhile."""
        self.reapers = [r for r in self.reapers if r.ident is None or r.is_alive()]
        for reaper in self.reapers:
            if reaper.ident is None:
                reaper.start()

    def _note_trained(self) -> None:
        """Rank 0, once: the job's first step completed (the coordinator tells a script that fails
        before it from a fault spares can cover). Called where each host counts a step (DeepSpeed's
        ``engine.step``, megatron's ``iteration_done``), so that a loop of the user's own that does
        not use :meth:`steps` has it too."""
        if not self._trained and self.store is not None and self.generation.rank == 0:
            self.control.mark_trained()
        self._trained = True

    def _end_setup(self) -> None:
        """The loop's first step: a spare's set-up guard (setupguard.py) is lifted."""
        if self.setup_guard is not None:
            self.setup_guard.stop()
            self.setup_guard = None

    # ---- what each host framework says -----------------------------------------------------

    def roots(self) -> list:
        """Where the host keeps process-group handles (walked by :mod:`hotspare.rebuild`)."""
        raise NotImplementedError

    def host_groups(self) -> list:
        """The host's process groups (records taken before the old generation's are destroyed)."""
        return rebuild.find_groups(self.roots())

    def check_host_groups(self, records) -> None:
        """Before any group of the new generation is made: every rank must rebuild the same ones."""
        rebuild.check_signature(records, self.generation.world_size)

    def rebuild_host_groups(self, records) -> list:
        """The host's groups anew in the current generation, every handle re-pointed; returns the
        records of the new groups (the host holds them from here on)."""
        mapping = rebuild.create_groups(records, self.config.recovery.collective_timeout_s, backend=self.backend)
        rebuild.repoint_records(records, mapping)
        return [dataclasses.replace(r, group=mapping[id(r.group)]) for r in records]

    def stages(self, group) -> list[int] | None:
        """Every rank's pipeline stage (collective over ``group``), or None without pipelines."""
        return None

    def compute_modules(self) -> list:
        """The modules whose forward time is this rank's compute time (hotspare.stragglers)."""
        return []

    def step_entry(self) -> list:
        """The modules whose forward begins a step, before any of the host's own hooks (where a
        handed-over rank leaves)."""
        return []

    def peer_class(self) -> int:
        """The ranks this one's compute time is compared with share it (a pipeline stage)."""
        return 0

    def uncomputable(self) -> str | None:
        """Why this job's compute time cannot be told from its waits (None: it can)."""
        return None

    def close(self) -> None:
        """Stop mirroring, write the queued checkpoints, leave the current generation; call once at
        the end of training."""
        self._end_setup()
        if self.mirror is not None:
            try:  # the last round, so that no peer's round fails on a transport closed under it
                self.mirror.flush(self.config.mirror.timeout_s)
            except MirrorError:
                pass  # a peer is gone already: nothing left to mirror to
            self.mirror.close()
            self.mirror = None
        if self.checkpoints is not None:
            self.checkpoints.close()
            self.checkpoints = None
        sources.drop_kept(self)
        for old in self.retired_mirrors:
            if not old.join():
                log(f"rank {self.generation.rank}: a mirror thread of generation {old.generation} is still blocked "
                     f"in a transfer after {old.timeout_s + 5} s")
        self.retired_mirrors = []
        if self.handover is not None:
            self.handover.close()
            self.handover = None
        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None
        for hook in self._interrupts:
            hook.remove()
        self._interrupts = []
        if self.events is not None:
            self.events.close()
        for group in self.groups:
            dist.destroy_process_group(group)
        self.groups = ()
        leave()
        for reaper in self.reapers:
            reaper.finish()
        self.reapers = []
        self.store = None
