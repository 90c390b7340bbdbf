"""The megatron-core session: the loop (``steps``, ``iteration_done``), the persistent checkpoint
through ``dist_checkpointing``, and the host hooks that rebuild every ``parallel_state`` group
in place and re-point the handles the model and optimizer hold."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ... import checkpoint, rebuild, stragglers
from ...events import log
from ...recovery import RecoveryError
from ...session import Session
from ...startup import gather_ints
from .state import MegatronState, extras_file


def warm_up_checkpoint_writer() -> threading.Thread | None:
    """Start what megatron-core 0.16.1's first ``dist_checkpointing.save`` would start on the
    training thread: a multiprocessing manager process (spawned: a fresh interpreter, about 3 s
    here) that the writers report through, kept for the process's life. Started on a thread of
    its own at initialisation; :meth:`MegatronSession.save_checkpoint` joins it first. None when
    this megatron-core keeps no such manager (tests/test_megatron_shim.py pins that it does)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    start = getattr(filesystem_async, "_get_write_results_queue", None)
    if start is None:
        return None
    thread = threading.Thread(target=start, name="hotspare-checkpoint-warm-up", daemon=True)
    thread.start()
    return thread


def parallel_state_groups() -> dict[str, dist.ProcessGroup]:
    """``parallel_state``'s process groups by global name (lists and dicts of groups by
    ``NAME[i]``/``NAME[key]``): what :func:`initialize_model_parallel` makes, by role."""
    from megatron.core import parallel_state as ps

    out = {}
    for name, value in sorted(vars(ps).items()):
        if isinstance(value, dist.ProcessGroup):
            out[name] = value
        elif name != "_global_process_group_list" and isinstance(value, (list, tuple, dict)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(item, dist.ProcessGroup):
                    out[f"{name}[{key}]"] = item
    return out


@dataclass(kw_only=True)
class MegatronSession(Session):
    """What :func:`initialize` returns: the caller's megatron-core objects plus hotspare's handles.

    The training loop gains failover with two lines, as on DeepSpeed::

        @session.resilient
        def train_step(iteration):           # one whole iteration
            model[0].zero_grad_buffer(); optimizer.zero_grad()
            forward_backward(forward_step_func=..., data_iterator=batches(iteration), model=model, ...)
            optimizer.step(); scheduler.step(increment=samples_per_iteration)

        for iteration in session.steps(total_iterations):
            train_step(iteration)

    ``steps`` counts the iterations and mirrors the state after each one that completes (and
    saves a persistent checkpoint every ``checkpoint.every`` iterations); after a recovery it
    yields the landing iteration again, so the interrupted one (and any a survivor had run past
    it) is run again with the same batches.
    """

    model: list
    """The model chunks (megatron-core DDP modules), as ``build`` returned them."""
    optimizer: Any
    """What ``get_megatron_optimizer`` returned."""
    scheduler: Any
    """The ``OptimizerParamScheduler`` (or None)."""
    parallel: dict
    """``initialize_model_parallel``'s arguments: every generation builds the same groups from them."""
    state: MegatronState | None = None
    same_layout_everywhere: bool = False
    checkpoint_warm_up: threading.Thread | None = None
    """The checkpoint writer's warm-up (:func:`warm_up_checkpoint_writer`), joined before the first save."""
    ps_groups: dict = field(default_factory=dict)
    """``parallel_state``'s groups by name, the ones the model and optimizer point at."""

    def interruptible(self) -> list:
        # Every block of every chunk checks for the alarm before its forward (modules with
        # children: one hook per block, not per layer). A tensor-parallel forward's collectives
        # raise on the broken connections anyway; the check stops the training thread from
        # posting more of them on the failed generation's groups after the alarm, and makes a
        # forward with none (one tensor-parallel rank) leave at its next block.
        return [m for chunk in self.model for m in chunk.modules() if next(m.children(), None) is not None]

    def step_count(self) -> int:
        return self.state.iteration

    def steps(self, total: int):
        self._end_setup()
        while self.state.iteration < total:
            recoveries = len(self.recoveries)
            yield self.state.iteration
            if len(self.recoveries) == recoveries:  # the iteration completed (not recovered)
                try:
                    self.iteration_done()
                except Exception as exc:  # noqa: BLE001 - classified below
                    if not self._can_recover(exc):
                        raise
                    self.recover(exc)
                    continue
                if self.catching_up is not None:
                    self._note_caught_up()  # (counted here: resilient returned before the count moved)
        if self.handover is not None:
            self.handover.disarm()

    def iteration_done(self) -> None:
        """One iteration has completed (optimizer and scheduler stepped): count it and mirror the
        new state. :meth:`steps` calls it; a loop of its own calls it after each iteration."""
        self.state.iteration += 1
        self._note_trained()
        if self.mirror is not None:
            self.mirror.on_step(self.state.iteration, self.state.tensors, self.state.meta)
        ck = self.config.checkpoint if self.config is not None and self.config.enabled else None
        if ck is not None and ck.enabled and self.state.iteration % ck.every == 0:
            self.save_checkpoint()
        if self.handover is not None:  # its compute time out; a standing order: leave at the next forward
            self.handover.after_step(self.state.iteration - 1)

    def save_checkpoint(self) -> None:
        """Save a persistent checkpoint of the current iteration (collective: every rank): the model
        chunks and the distributed optimizer through ``dist_checkpointing.save`` into
        ``<checkpoint.dir>/global_step<N>``, this rank's RNG states, scheduler, data position and
        iteration beside them (:func:`extras_file`), then its completion marker
        (:mod:`hotspare.checkpoint`). It runs on the training thread: megatron-core 0.16.1's
        asynchronous save needs its own queue of calls finalised collectively. A tag that is
        complete already is not written again: the run that rolled back to before it and came
        back to it is at the same state (bitwise, with deterministic algorithms; on GPUs without
        them the kept one is of the abandoned timeline, a consistent state all the same). What a
        save cut short by a failure left is removed first; a directory that cannot be made empty
        skips this save on every rank, saying why.

        Each rank reads only its own marker and the ranks agree (a MIN all-reduce), and rank 0
        alone prunes, after a barrier: W markers read per save, not W squared."""
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint.api import CheckpointException

        ck, gen, it = self.config.checkpoint, self.generation, self.state.iteration
        tag = checkpoint.tag_of(it)
        path = os.path.join(ck.dir, tag)
        t0 = time.monotonic()
        if self.checkpoint_warm_up is not None:
            self.checkpoint_warm_up.join(timeout=120.0)  # (the save would start another one meanwhile)
            self.checkpoint_warm_up = None
        # On the default group (NCCL on GPUs: its tensors must be on the device).
        device = rebuild.collective_device()

        def everywhere(flag: bool) -> bool:
            t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            return bool(int(t))

        if everywhere(checkpoint.rank_done(ck.dir, tag, gen.rank, gen.world_size)):
            self.events("checkpoint_skipped", version=it, tag=tag, reason="complete already")
            return
        problem = ""
        if gen.rank == 0:
            try:
                shutil.rmtree(path, ignore_errors=True)
                os.makedirs(path, exist_ok=True)
                left = os.listdir(path)
                if left:
                    problem = f"{path} could not be emptied ({len(left)} entries left, e.g. {left[0]!r})"
            except OSError as exc:
                problem = f"{path} could not be made: {exc}"
        if not everywhere(not problem):
            why = problem or "rank 0 could not prepare the directory (its log says why)"
            self.events("checkpoint_skipped", version=it, tag=tag, reason=why)
            log(f"rank {gen.rank}: checkpoint of iteration {it} skipped: {why}; the previous one stays the newest")
            return
        try:
            dist_checkpointing.save(self.state.sharded_state_dict(), path)
        except CheckpointException as exc:  # a BaseException: made an error that names the checkpoint
            raise checkpoint.CheckpointWriteError(f"dist_checkpointing could not write {path}: {exc}; that tag is "
                                                  f"incomplete and will not be loaded") from None
        name = extras_file(gen.rank)
        torch.save(self.state.extras(), os.path.join(path, name + ".tmp"))
        os.replace(os.path.join(path, name + ".tmp"), os.path.join(path, name))
        checkpoint.write_marker(ck.dir, tag, gen.rank, gen.world_size, [name],
                                os.path.getsize(os.path.join(path, name)))
        dist.barrier()  # every marker is there: rank 0 sees the tag complete before it prunes
        deleted = checkpoint.prune(ck.dir, gen.world_size, ck.keep) if gen.rank == 0 else []
        self.events("checkpoint_saved", version=it, tag=tag, seconds=time.monotonic() - t0, deleted=deleted)
        if gen.rank == 0:
            log(f"rank 0: checkpoint {path} saved in {time.monotonic() - t0:.2f} s")

    def roots(self) -> list:
        from megatron.core import parallel_state as ps

        return [self.model, self.optimizer, self.scheduler, ps]

    def compute_modules(self) -> list:
        return list(self.model)

    def step_entry(self) -> list:
        return list(self.model)  # the DDP wrappers: before their inner modules' parameter-gather hooks

    def peer_class(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_rank()

    def uncomputable(self) -> str | None:
        from megatron.core import parallel_state as ps

        return stragglers.measurable(tensor_parallel=ps.get_tensor_model_parallel_world_size())

    def stages(self, group) -> list[int]:
        from megatron.core import parallel_state as ps

        return gather_ints(ps.get_pipeline_model_parallel_rank(), group)

    def check_host_groups(self, records) -> None:
        # Each rank holds only its own groups (its stage's data-parallel group, its pipeline...),
        # so the ranks agree on what makes them all: the parallel layout.
        rebuild.check_same(json.dumps(self.parallel, sort_keys=True, default=str),
                           "the megatron-core parallel layout (initialize_model_parallel's arguments)")

    def rebuild_host_groups(self, records) -> list:
        """``initialize_model_parallel`` again in the new generation (collective: every rank makes
        every group), then each old handle the model and optimizer hold is re-pointed to the new
        group of the same name."""
        from megatron.core import parallel_state as ps

        old = self.ps_groups
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(**self.parallel)
        new = parallel_state_groups()
        mapping: dict[int, dist.ProcessGroup] = {}
        for name, group in old.items():
            if name not in new:
                raise RecoveryError(f"parallel_state.{name} held a process group before the rebuild and none after "
                                    f"initialize_model_parallel({self.parallel}); it cannot be re-pointed")
            if mapping.setdefault(id(group), new[name]) is not new[name]:
                raise RecoveryError(f"parallel_state.{name} aliased another group before the rebuild but not after; "
                                    f"this megatron-core's groups are not rebuilt by name")
        try:
            rebuild.repoint([self.model, self.optimizer, self.scheduler], mapping)
        except RuntimeError as exc:
            raise RecoveryError(f"{exc} (the model or optimizer holds a process group that is not one of "
                                f"megatron-core's parallel_state groups; hotspare rebuilds only those)") from None
        self.ps_groups = new
        return rebuild.find_groups(self.roots())

    def close(self) -> None:
        super().close()
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


def fence_optimizer_step(session: MegatronSession) -> None:
    """Wrap the optimizer's ``step``: on an accelerator the last capture's device-to-host copy must
    have read the shards before the step changes them (the device waits; not the host)."""
    step = session.optimizer.step

    def fenced_step(*args, **kwargs):
        if session.mirror is not None:
            session.mirror.before_update()
        return step(*args, **kwargs)

    session.optimizer.step = fenced_step
