"""``hotspare.initialize`` on DeepSpeed: ``deepspeed.initialize`` with the ``"hotspare"`` section,
a spare's wait for its order, and :class:`DeepSpeedSession` (the engine's host hooks for the
session: where its groups live, which modules check the alarm, the persistent checkpoint)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ... import accelerator, checkpoint, env, identity, stragglers
from ...config import split_deepspeed_config, to_mapping
from ...position import data_hooks
from ...session import Session
from ...startup import default_group_timeout, goodbye_on_error
from ..base import begin, enter, import_host, is_off, require_version
from .checkpoint_engine import make_engine
from .state import DeepSpeedState
from .warmup import warm_up_spare

SUPPORTED_DEEPSPEED = ("0.19.",)


def check_version() -> str:
    deepspeed = import_host("deepspeed", "deepspeed")
    return require_version("DeepSpeed", deepspeed.__version__, SUPPORTED_DEEPSPEED,
                           "a supported version (requirements.txt pins one)")


@dataclass(kw_only=True)
class DeepSpeedSession(Session):
    """What ``hotspare.initialize`` returns: the DeepSpeed objects plus hotspare's handles.

    The training loop gains failover with two lines (see :meth:`resilient` and :meth:`steps`)::

        @session.resilient
        def train_step(step):
            loss = engine(batch(step)); engine.backward(loss); engine.step()
            return loss

        for step in session.steps(total_steps):
            train_step(step)
    """

    engine: Any
    """The ``DeepSpeedEngine``."""
    optimizer: Any
    """The (ZeRO-wrapped) optimizer, as ``deepspeed.initialize`` returns it."""
    training_dataloader: Any
    """DeepSpeed's dataloader, when ``training_data`` was passed."""
    lr_scheduler: Any
    """The LR scheduler, when one was configured."""
    state: "DeepSpeedState | None" = None
    """What this rank mirrors."""

    def step_count(self) -> int:
        return self.engine.global_steps

    def compute_modules(self) -> list:
        # ZeRO 3: each leaf, timed after DeepSpeed's pre-hook gathered its parameters (the clock's
        # hooks are registered after the engine's); ZeRO 1/2: the whole forward (no collective).
        if self.engine.zero_optimization_stage() == 3:
            return stragglers.leaves(self.engine.module)
        return [self.engine.module]

    def step_entry(self) -> list:
        return [self.engine]  # the engine's own forward: before ZeRO 3's fetch hooks on its module

    def uncomputable(self) -> str | None:
        return None

    def interruptible(self) -> list:
        # ZeRO 1/2's forward runs no collective: the blocks of the model check for the alarm
        # (modules with children: a hook per block, not per layer). ZeRO 3's forward gathers
        # parameters, which raise at once on the broken connections (and a hook raising between
        # its own fetch hooks would leave its parameter coordinator mid-fetch).
        if self.engine.zero_optimization_stage() == 3:
            return []
        return [m for m in self.engine.module.modules() if next(m.children(), None) is not None]

    def roots(self) -> list:
        """Where DeepSpeed keeps process-group handles (walked by :mod:`hotspare.rebuild`)."""
        import deepspeed.comm.comm
        import deepspeed.utils.groups

        return [self.engine, deepspeed.utils.groups, deepspeed.comm.comm]

    def save_checkpoint(self) -> None:
        """Save a persistent DeepSpeed checkpoint of the current step (collective: every rank).

        The files are DeepSpeed's own; hotspare adds the RNG states and data position as client
        state, and the writes happen on the background writer thread.
        """
        ck, e = self.config.checkpoint, self.engine
        t0 = time.monotonic()
        e.save_checkpoint(ck.dir, tag=checkpoint.tag_of(e.global_steps), save_latest=False,
                          client_state={"hotspare": self.state.extras()})
        self.events("checkpoint_start", version=e.global_steps, seconds=time.monotonic() - t0,
                    wait_s=self.checkpoints.last_wait_s)


def initialize(model: torch.nn.Module, config: dict | str, *, model_parameters=None, optimizer=None,
               lr_scheduler=None, training_data=None, collective_timeout_s: float | None = None, data_state=None,
               load_data_state=None, **kwargs) -> DeepSpeedSession:
    """``deepspeed.initialize`` with hotspare: validates the ``"hotspare"`` section first.

    The process group is joined through the launcher's control store (``hotspare-run``), on
    the generation's own store prefix, unless the caller already initialised one.
    ``data_state`` (optional) returns the data position as JSON-able values; it is mirrored,
    and ``load_data_state`` gets it back at a restore.
    With mirroring on, ``engine.step()`` mirrors the unique state after every optimizer step.

    A spare (``HOTSPARE_ROLE=spare``, started by ``hotspare-run --spares-per-node``) waits
    here for a takeover order; it returns a Session for the rank it took, restored to the
    landing version, or exits the process (status 0) when the job ends first.
    """
    ds_config, hs_config = split_deepspeed_config(config)
    data_state, load_data_state, data_said = data_hooks(data_state, load_data_state)
    env.configure_accelerator()
    check_version()
    import deepspeed

    from deepspeed.accelerator import get_accelerator

    accelerator.use(get_accelerator())  # the mirror's streams and pinned buffers go through DeepSpeed's
    backend = get_accelerator().communication_backend_name()
    if collective_timeout_s is None:
        collective_timeout_s = hs_config.recovery.collective_timeout_s if hs_config is not None else 120.0
    fp = identity.fingerprint({"deepspeed": ds_config, "hotspare": to_mapping(hs_config) if hs_config else None},
                              {"deepspeed": deepspeed.__version__})
    entry = enter(hs_config, backend, collective_timeout_s, fp, lambda: warm_up_spare(ds_config))
    gen = entry.generation
    deepspeed.init_distributed(dist_backend=backend)
    # DeepSpeed creates its groups without a timeout (torch's default: 30 min for gloo, 10 for
    # NCCL); they get the job's collective timeout, the backstop that finds a stuck peer.
    with goodbye_on_error(entry.heartbeat), default_group_timeout(collective_timeout_s):
        engine, opt, loader, sched = deepspeed.initialize(
            model=model, config=ds_config, model_parameters=model_parameters, optimizer=optimizer,
            lr_scheduler=lr_scheduler, training_data=training_data, **kwargs)
        if engine.zero_optimization_stage() not in (1, 2, 3):
            raise ValueError(f"zero_optimization.stage={engine.zero_optimization_stage()}: hotspare needs ZeRO "
                             f"stage 1, 2 or 3 (each rank's unique state is its ZeRO partition)")
    session = DeepSpeedSession(engine=engine, optimizer=opt, training_dataloader=loader, lr_scheduler=sched,
                               config=hs_config, generation=gen, store=entry.store, heartbeat=entry.heartbeat,
                               spare=entry.spare, backend=backend, pin_memory=get_accelerator().device_name() != "cpu")
    if is_off(hs_config, gen.rank, "the DeepSpeed config"):
        return session
    session.state = DeepSpeedState(engine, data_state, load_data_state, spare=entry.spare)
    begin(session, data_said, get_accelerator().device_name())
    if hs_config.checkpoint.enabled:
        session.checkpoints = engine.checkpoint_engine = make_engine(
            gen.rank, gen.world_size, hs_config.checkpoint.keep, session.events)
    _wrap_step(session)
    session.start(entry.order)
    return session


def _wrap_step(session: DeepSpeedSession) -> None:
    """Wrap the one call every DeepSpeed loop makes: after an optimizer step (global_steps moved)
    the post-step state is captured and its copy starts on the mirror thread, the step's compute
    time goes out, and a requested handover happens. Here rather than in ``steps``: a loop of the
    user's own (``while engine.global_steps < total``) gets all of it too."""
    engine = session.engine
    step = engine.step

    def step_and_mirror(*args, **kw):
        before = engine.global_steps
        if session.mirror is not None:
            session.mirror.before_update()  # the last capture's device-to-host copy read the state first
        out = step(*args, **kw)
        if engine.global_steps == before:
            return out  # a micro-step inside gradient accumulation
        mirror = session.mirror
        if session.state.watching:
            session.state.watch(session.generation.rank == 0)
        if mirror is not None:
            mirror.on_step(engine.global_steps, session.state.tensors, session.state.meta)
        if session.checkpoints is not None and engine.global_steps % session.config.checkpoint.every == 0:
            session.save_checkpoint()
        session._note_trained()
        if session.handover is not None:  # its compute time out; a standing order: leave at the next forward
            session.handover.after_step(engine.global_steps - 1)
        return out

    engine.step = step_and_mirror
