"""megatron-core: mirroring and in-place recovery of a pipeline-parallel x data-parallel job.

:func:`initialize` sets up ``parallel_state`` and the caller's model, optimizer and scheduler
(built by the caller's ``build`` function, so that a spare builds the rank it takes) and
returns a :class:`MegatronSession`; :class:`MegatronState` is what the mirror, keeper and
restore need from a rank (the razor, as :class:`hotspare.integrations.deepspeed.DeepSpeedState`
does for ZeRO). At a recovery every ``parallel_state`` group is made anew for the new
generation by ``initialize_model_parallel`` with the job's arguments, and every handle the
model and optimizer hold (DDP, its buckets, the distributed optimizer's own bucket groups, the
model's ``pg_collection`` and per-layer ``tp_group``...) is re-pointed by global name.

Where megatron-core 0.16.1 keeps it (pinned by tests/test_megatron_pipeline.py):

- ``get_megatron_optimizer`` returns a ``ChainedOptimizer``; each of its
  ``chained_optimizers`` is a ``DistributedOptimizer`` whose ``shard_fp32_groups`` (fp32
  parameters) and ``shard_fp32_from_float16_groups`` (fp32 masters of bf16/fp16 ones) are this
  data-parallel rank's 1/d of its stage's parameters; with fp32 parameters the shards are
  views into DDP's parameter buffer;
- the inner torch optimizer's ``state[shard]`` holds Adam's ``step``, ``exp_avg`` and
  ``exp_avg_sq`` for each shard;
- ``OptimizerParamScheduler``'s only moving state is ``num_steps`` (``load_state_dict`` adds
  to it, so it is set, then ``step(0)`` recomputes the learning rate and weight decay);
- the RNG: torch's default generator, the tracker's named states (dropout), Python's and
  NumPy's generators.

The stage's full weights are not unique: after the shards are restored, every data-parallel
rank all-gathers them (:meth:`MegatronState.resync`).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import checkpoint, identity, rebuild
from ..config import DEEPSPEED_SECTION, ConfigError, HotspareConfig, from_mapping, to_mapping
from ..events import EventLog, log
from ..generation import Generation
from ..position import NO_DATA_HOOKS, data_hooks
from ..recovery import RecoveryError
from ..session import Session
from ..startup import (await_takeover, gather_ints, goodbye_on_error, heartbeat_for, import_modules, join_from_env,
                       keeper_for)
from ..snapshot import Layout, read_meta
from ..worker import role

SUPPORTED_MEGATRON = ("0.16.",)
CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""What the sharded state dicts of a persistent checkpoint are built with: the distributed
optimizer's state in the data-parallel-reshardable form, which megatron-core 0.16.1 saves and
loads without Apex or Transformer Engine."""


def check_version() -> str:
    from megatron.core import package_info

    version = package_info.__version__
    if not version.startswith(SUPPORTED_MEGATRON):
        raise RuntimeError(f"hotspare supports megatron-core {', '.join(v + 'x' for v in SUPPORTED_MEGATRON)}; "
                           f"{version} is installed (its optimizer internals may differ): install "
                           f"megatron-core>=0.16,<0.17")
    return version


def distributed_optimizers(optimizer) -> list:
    """The ``DistributedOptimizer``s inside what ``get_megatron_optimizer`` returned."""
    inner = getattr(optimizer, "chained_optimizers", None)
    return list(inner) if inner is not None else [optimizer]


def shards(optimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of this rank's fp32 shards, in a fixed order."""
    out = []
    for i, do in enumerate(distributed_optimizers(optimizer)):
        for kind, groups in (("fp32", getattr(do, "shard_fp32_groups", ())),
                             ("main", getattr(do, "shard_fp32_from_float16_groups", ()))):
            for g, group in enumerate(groups):
                out += [(f"{kind}.{i}.{g}.{j}", p) for j, p in enumerate(group)]
    return out


class MegatronState:
    """The unique state of one megatron-core rank, in the contract the mirror and the restore use
    (``tensors``, ``meta``, ``restore``, ``resync``)."""

    def __init__(self, model_chunks: list, optimizer, scheduler=None, data_state=None, load_data_state=None):
        self.model_chunks, self.optimizer, self.scheduler = list(model_chunks), optimizer, scheduler
        self.data_state, self.load_data_state = data_state, load_data_state
        self.iteration = 0
        """Iterations done (optimizer steps taken): the version the state is at."""
        self._shards = shards(optimizer)
        self._inner = {id(p): do.optimizer for do in distributed_optimizers(optimizer)
                       for _, p in shards(do)}

    def _tracker(self):
        from megatron.core.tensor_parallel import random as mrandom

        return mrandom.get_cuda_rng_tracker()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = []
        for name, p in self._shards:
            named.append((name, p.detach().reshape(-1)))
            state = self._inner[id(p)].state.get(p, {})
            named += [(f"optim.{name}.{k}", v.reshape(-1)) for k, v in sorted(state.items()) if torch.is_tensor(v)]
        named.append(("rng.torch", torch.get_rng_state()))
        if torch.cuda.is_available():
            named.append(("rng.cuda", torch.cuda.get_rng_state()))
        for key, state in sorted(self._tracker().get_states().items()):
            named.append((f"rng.tracker.{key}", state))
        named.append(("rng.python", torch.tensor(random.getstate()[1], dtype=torch.int64)))
        named.append(("rng.numpy", torch.from_numpy(np.random.get_state()[1].astype(np.int64))))
        return named

    def meta(self) -> dict:
        py, nps = random.getstate(), np.random.get_state()
        meta = {"iteration": self.iteration,
                "rng_python": {"version": py[0], "gauss_next": py[2]},
                "rng_numpy": {"kind": nps[0], "pos": int(nps[2]), "has_gauss": int(nps[3]),
                              "cached_gaussian": float(nps[4])}}
        if self.scheduler is not None:
            meta["scheduler_steps"] = int(self.scheduler.num_steps)
        if self.data_state is not None:
            meta["data"] = self.data_state()
        group_steps = [[int(g["step"]) if "step" in g else None for g in inner.param_groups]
                       for inner in self._inner_optimizers()]
        if any(v is not None for steps in group_steps for v in steps):
            # Transformer Engine's and Apex's FusedAdam (megatron-core's first choice where they are
            # installed) count steps per param group, not per parameter: the bias correction.
            meta["group_steps"] = group_steps
        return meta

    def _inner_optimizers(self) -> list:
        return [do.optimizer for do in distributed_optimizers(self.optimizer)]

    def restore(self, buf: torch.Tensor, layout: Layout, tensors_from: torch.Tensor | None = None) -> None:
        """Put snapshot ``buf`` back: shards and optimizer state in place (every alias sees
        them), RNG states, the scheduler, the data position. :meth:`resync` must follow.
        ``tensors_from``: the same snapshot on the device (the keeper's device copy), read for
        every tensor but the RNG states."""
        self._conform(layout)
        live = self.tensors()
        if not layout.matches(live):
            raise RuntimeError(f"the snapshot's layout ({layout.nbytes} bytes, {len(layout.segments)} tensors) is not "
                               f"this rank's ({Layout.of(live).nbytes} bytes, {len(live)} tensors): the spare's model "
                               f"or optimizer differs from the rank it replaces")
        views = {seg.name: v for seg, v in zip(layout.segments, layout.views(buf))}
        meta = read_meta(buf, layout)
        source = views if tensors_from is None else dict(zip(views, layout.views(tensors_from)))
        with torch.no_grad():
            for name, tensor in live:
                if not name.startswith("rng."):
                    tensor.copy_(source[name])
        self._apply(meta, views)

    def sharded_state_dict(self, is_loading: bool = False) -> dict:
        """The model chunks' and the optimizer's sharded state dicts, as ``dist_checkpointing``
        saves and loads them (``model``, or ``model0``, ``model1``... for several chunks, and
        ``optimizer``). Each chunk's own module's: DDP's sharded_state_dict prefixes ``module.``
        and its load_state_dict does not."""
        model = {}
        for i, chunk in enumerate(self.model_chunks):
            key = "model" if len(self.model_chunks) == 1 else f"model{i}"
            model[key] = chunk.module.sharded_state_dict(metadata=CHECKPOINT_METADATA)
        # The optimizer finds each parameter's sharded tensor in the nested dicts, as
        # megatron-core's own checkpointing passes them (chunks keep their own layer numbers).
        return {**model, "optimizer": self.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                                         metadata=CHECKPOINT_METADATA)}

    def load_checkpoint(self, directory: str, tag: str) -> None:
        """Load a checkpoint saved by :meth:`MegatronSession.save_checkpoint` into the live objects,
        in place, with its RNG states, scheduler, data position and iteration, then all-gather the
        weights (collective: every rank of the generation)."""
        from megatron.core import dist_checkpointing

        path = os.path.join(directory, tag)
        extras_path = os.path.join(path, extras_file(dist.get_rank()))
        if not os.path.exists(extras_path):
            raise RecoveryError(f"the checkpoint {path} has no {extras_file(dist.get_rank())}: it was not saved by "
                                f"hotspare (no RNG states or data position); resuming from it would not be the same run")
        self.ensure_optimizer_state()
        state = dist_checkpointing.load(self.sharded_state_dict(is_loading=True), path)
        for i, chunk in enumerate(self.model_chunks):
            chunk.module.load_state_dict(state["model" if len(self.model_chunks) == 1 else f"model{i}"])
        steps = self._checkpoint_steps(state["optimizer"], path)
        with torch.no_grad():  # fp32 parameters: the optimizer's shards are views of them (leaves that need grad)
            self.optimizer.load_state_dict(state["optimizer"])
        # megatron-core 0.16.1 without Apex or Transformer Engine gives every shard's Adam state
        # one shared step tensor with the checkpoint's count, then copies the live count over
        # it (the dp_reshardable parameter state carries the live 'step', not the saved one), and
        # torch's Adam would add 1 to that shared tensor once per shard: each shard gets a step
        # of its own with the checkpoint's count (tests/test_megatron_recover.py's fallback).
        # The checkpoint carries that count in each param group's 'step' too, and the load leaves
        # it there; torch's Adam never reads or writes it (a run that never failed has none), so
        # it goes (Apex's and TE's FusedAdam keep their count there instead, and no 'step' in the
        # per-shard state: theirs stays).
        for do, step in zip(distributed_optimizers(self.optimizer), steps):
            per_shard = False
            for st in do.optimizer.state.values():
                if "step" in st:
                    st["step"] = torch.tensor(step, dtype=st["step"].dtype, device=st["step"].device)
                    per_shard = True
            if per_shard:
                for group in do.optimizer.param_groups:
                    group.pop("step", None)
        self.load_extras(torch.load(extras_path, weights_only=True))
        self.resync()

    def _checkpoint_steps(self, optimizer_state: dict, path: str) -> list[float]:
        """The Adam step count a checkpoint holds for each distributed optimizer (one per param group,
        all the same)."""
        dos = distributed_optimizers(self.optimizer)
        per = [optimizer_state] if len(dos) == 1 else [v for _, v in sorted(optimizer_state.items())]
        steps = []
        for i, sd in enumerate(per):
            found = {float(g["step"]) for g in sd["optimizer"]["param_groups"] if "step" in g}
            if len(found) != 1:
                raise RecoveryError(f"the checkpoint {path} holds {len(found)} different step counts for optimizer "
                                    f"{i} ({sorted(found)}); expected one")
            steps.append(found.pop())
        return steps

    def extras(self) -> dict:
        """What a megatron-core checkpoint lacks for a bitwise resume: the metadata (iteration,
        scheduler, RNG and data positions) and the RNG states."""
        return {"meta": self.meta(), "rng": {n: t.clone() for n, t in self.tensors() if n.startswith("rng.")}}

    def load_extras(self, extras: dict) -> None:
        """Put :meth:`extras` back (after the checkpoint's tensors were loaded)."""
        self._apply(extras["meta"], extras["rng"])

    def _apply(self, meta: dict, views: dict) -> None:
        """RNG states, the scheduler, the data position and the iteration count."""
        torch.set_rng_state(views["rng.torch"].clone())
        if "rng.cuda" in views:
            torch.cuda.set_rng_state(views["rng.cuda"].clone())
        tracker = self._tracker()
        tracker.set_states({name[len("rng.tracker."):]: v.clone() for name, v in views.items()
                            if name.startswith("rng.tracker.")})
        py, nps = meta["rng_python"], meta["rng_numpy"]
        random.setstate((py["version"], tuple(int(x) for x in views["rng.python"].tolist()), py["gauss_next"]))
        np.random.set_state((nps["kind"], views["rng.numpy"].numpy().astype(np.uint32), nps["pos"],
                             nps["has_gauss"], nps["cached_gaussian"]))
        if self.scheduler is not None and "scheduler_steps" in meta:
            self.scheduler.num_steps = meta["scheduler_steps"]
            self.scheduler.step(0)  # the learning rate and weight decay of that step, into the param groups
        if "data" in meta and self.load_data_state is not None:
            self.load_data_state(meta["data"])
        for inner, steps in zip(self._inner_optimizers(), meta.get("group_steps", [])):
            for g, step in zip(inner.param_groups, steps):
                if step is None:
                    g.pop("step", None)
                elif torch.is_tensor(g.get("step")):
                    g["step"].fill_(step)
                else:
                    g["step"] = step
        self.iteration = int(meta["iteration"])

    def bytes_per_param(self) -> float:
        """Unique bytes this rank mirrors per parameter of its stage (its data-parallel group
        together): about 12 for fp32 Adam (master, two moments), whatever the data-parallel size."""
        from megatron.core import parallel_state as ps

        nbytes = sum(t.numel() * t.element_size() for _, t in self.tensors())
        num_params = sum(p.numel() for chunk in self.model_chunks for p in chunk.parameters())
        return nbytes * ps.get_data_parallel_world_size() / max(1, num_params)

    def layout_for(self, layout_id: int) -> Layout | None:
        """This rank's layout with id ``layout_id`` (with or without Adam's state), or None.

        torch's Adam creates its state at the first step: a snapshot of iteration 0 has none,
        every later one has; a rank that has not stepped yet (a spare) gets it created (then
        overwritten by the restore) to take a later version.
        """
        layout = Layout.of(self.tensors())
        if layout.id == layout_id:
            return layout
        had = self._has_optimizer_state()
        self._set_optimizer_state(not had)
        other = Layout.of(self.tensors())
        if other.id == layout_id:
            return other
        self._set_optimizer_state(had)
        return None

    def ensure_optimizer_state(self) -> None:
        """Create Adam's per-shard state if the optimizer has not stepped yet (values to be
        overwritten): megatron-core 0.16.1 without Apex or Transformer Engine cannot build the
        sharded state dict a ``dist_checkpointing.load`` needs before that
        (``DistributedOptimizer.state_dict`` asserts exactly one step count)."""
        if not self._has_optimizer_state():
            self._set_optimizer_state(True)

    def _has_optimizer_state(self) -> bool:
        return any(self._inner[id(p)].state.get(p) for _, p in self._shards)

    def _conform(self, layout: Layout) -> None:
        wants = any(s.name.startswith("optim.") for s in layout.segments)
        if wants != self._has_optimizer_state():
            self._set_optimizer_state(wants)

    def _set_optimizer_state(self, present: bool) -> None:
        """Create (one zero-gradient inner step at learning rate 0: the optimizer's own shapes and
        dtypes) or drop Adam's per-shard state; the restore overwrites every value."""
        for inner in {id(o): o for o in self._inner.values()}.values():
            params = [p for g in inner.param_groups for p in g["params"]]
            if not present:
                for p in params:
                    inner.state.pop(p, None)
                continue
            saved = [dict(g) for g in inner.param_groups]
            with warnings.catch_warnings():  # fp32 shards are views into DDP's buffer (not leaves)
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

    def resync(self) -> None:
        """Drop what an interrupted iteration left (gradients, bucket state, handles of the dead
        generation's collectives), then every data-parallel rank all-gathers its stage's weights
        from the restored shards (collective)."""
        self.clear_interrupted_iteration()
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=True)

    def clear_interrupted_iteration(self) -> None:
        """Local: gradients and DDP bucket-group state as at the start of an iteration.

        Every bucket group goes back to its first-batch mode (gradients reduced at the end of
        the backward, then the per-parameter counts recorded again), on every rank alike: a
        spare's groups are new, and an interrupted backward leaves partial counts that DDP
        would otherwise record as the iteration's shape. The reduced values do not depend on
        when a reduction starts, so the iteration is bitwise the same.
        """
        groups = []
        for chunk in self.model_chunks:
            groups += list(getattr(chunk, "bucket_groups", [])) + list(getattr(chunk, "expert_parallel_bucket_groups", []))
        for do in distributed_optimizers(self.optimizer):
            for per_model in getattr(do, "per_model_bucket_groups", {}).values():
                groups += list(per_model)
        for g in groups:
            g.grad_reduce_handle = None
            g.param_gather_handle = None
            g.param_gather_dispatched = False
            g.per_param_grad_ready_counts = {}
            g.golden_per_param_grad_ready_counts = {}
            g.is_first_batch = True
            g.is_last_microbatch = True
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()


def extras_file(rank: int) -> str:
    """The file beside a checkpoint's tensors that holds rank ``rank``'s :meth:`MegatronState.extras`."""
    return f"hotspare_extras.rank{rank}.pt"


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
    _checkpoint_warm_up: threading.Thread | None = None
    _ps_groups: dict = field(default_factory=dict)
    """``parallel_state``'s groups by name, the ones the model and optimizer point at."""

    def step_count(self) -> int:
        return self.state.iteration

    def steps(self, total: int):
        self._end_setup()
        while self.state.iteration < total:
            recoveries = len(self.recoveries)
            yield self.state.iteration
            if len(self.recoveries) == recoveries:  # the iteration completed (not recovered)
                self._note_trained()
                try:
                    self.iteration_done()
                except Exception as exc:  # noqa: BLE001 - classified below
                    if not self._can_recover(exc):
                        raise
                    self.recover(exc)
                    continue
                if self.catching_up is not None:
                    self._note_caught_up()  # (counted here: resilient returned before the count moved)

    def iteration_done(self) -> None:
        """One iteration has completed (optimizer and scheduler stepped): count it and mirror the
        new state. :meth:`steps` calls it; a loop of its own calls it after each iteration."""
        self.state.iteration += 1
        if self.mirror is not None:
            self.mirror.on_step(self.state.iteration, self.state.tensors, self.state.meta)
        ck = self.config.checkpoint if self.config is not None and self.config.enabled else None
        if ck is not None and ck.enabled and self.state.iteration % ck.every == 0:
            self.save_checkpoint()

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
        if self._checkpoint_warm_up is not None:
            self._checkpoint_warm_up.join(timeout=120.0)  # (the save would start another one meanwhile)
            self._checkpoint_warm_up = None
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

        old = self._ps_groups
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
        self._ps_groups = new
        return rebuild.find_groups(self.roots())

    def close(self) -> None:
        super().close()
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


def _fence_optimizer_step(session: MegatronSession) -> None:
    """Wrap the optimizer's ``step``: on an accelerator the last capture's device-to-host copy must
    have read the shards before the step changes them (the device waits; not the host)."""
    step = session.optimizer.step

    def fenced_step(*args, **kwargs):
        if session.mirror is not None:
            session.mirror.before_update()
        return step(*args, **kwargs)

    session.optimizer.step = fenced_step


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
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
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


def _build(build: Callable[[], tuple], parallel: dict, enabled: bool) -> tuple:
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
    spare = role() == "spare"
    store = heartbeat = order = None
    from megatron.core import package_info

    fp = identity.fingerprint({"parallel": parallel, "hotspare": to_mapping(hs) if hs else None},
                              {"megatron-core": package_info.__version__})
    if spare:
        order = await_takeover(hs, warm_up_spare, fingerprint=fp)
        store, heartbeat = order.store, order.heartbeat
        gen = Generation(order.generation - 1, order.rank, order.world_size)
        _use_local_device(backend)  # the rank's device (await_takeover set LOCAL_RANK), before the build
    elif dist.is_initialized():
        gen = Generation(index=0, rank=dist.get_rank(), world_size=dist.get_world_size())
    else:
        _use_local_device(backend)  # before the NCCL group and the model exist
        gen, store = join_from_env(backend, timeout_s, fp)
        if hs is not None and hs.enabled:
            heartbeat = heartbeat_for(hs, store)
    with goodbye_on_error(heartbeat):
        with _gloo_twins_fake_on_a_spare(spare):
            ps.initialize_model_parallel(**parallel)
        model, optimizer, scheduler = _build(build, parallel, hs is not None and hs.enabled)
    model = list(model) if isinstance(model, (list, tuple)) else [model]
    session = MegatronSession(model=model, optimizer=optimizer, scheduler=scheduler, parallel=parallel, config=hs,
                              generation=gen, store=store, heartbeat=heartbeat, spare=spare, backend=backend,
                              pin_memory=torch.cuda.is_available())
    session.state = MegatronState(model, optimizer, scheduler, data_state, load_data_state)
    session._checkpoint_warm_up = warm_up
    session._ps_groups = parallel_state_groups()
    _fence_optimizer_step(session)
    if hs is None or not hs.enabled:
        return session
    session.events = EventLog(hs.events_dir, gen.rank, gen.index)
    if not data_said and gen.rank == 0 and not spare:
        log(f"WARNING: {NO_DATA_HOOKS}")
    session.keeper = keeper_for(hs, "cuda" if torch.cuda.is_available() else "cpu")
    session.start(order)
    return session
