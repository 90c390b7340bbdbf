"""A megatron-core rank's unique state (:class:`MegatronState`): its shards of the distributed
optimizer's fp32 parameters and their Adam state, the tracker's RNG states, the scheduler and the
iteration; and the sharded state dicts of a persistent checkpoint. Where megatron-core keeps each
of them: see the package's documentation (:mod:`hotspare.integrations.megatron`)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ...recovery import RecoveryError
from ..base import HostState, zero_gradient_step

CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""What the sharded state dicts of a persistent checkpoint are built with: the distributed
optimizer's state in the data-parallel-reshardable form, which megatron-core 0.16.1 saves and
loads without Apex or Transformer Engine."""


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


class MegatronState(HostState):
    """The unique state of one megatron-core rank, in the contract the mirror and the restore use
    (``tensors``, ``meta``, ``restore``, ``resync``)."""

    def __init__(self, model_chunks: list, optimizer, scheduler=None, data_state=None, load_data_state=None):
        super().__init__(data_state, load_data_state)
        self.model_chunks, self.optimizer, self.scheduler = list(model_chunks), optimizer, scheduler
        self.iteration = 0
        """Iterations done (optimizer steps taken): the version the state is at."""
        self._shards = shards(optimizer)
        self._inner = {id(p): do.optimizer for do in distributed_optimizers(optimizer)
                       for _, p in shards(do)}

    def _tracker(self):
        from megatron.core.tensor_parallel import random as mrandom

        return mrandom.get_cuda_rng_tracker()

    def unique_tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = []
        for name, p in self._shards:
            named.append((name, p.detach().reshape(-1)))
            state = self._inner[id(p)].state.get(p, {})
            named += [(f"optim.{name}.{k}", v.reshape(-1)) for k, v in sorted(state.items()) if torch.is_tensor(v)]
        return named

    def device_rng_states(self) -> list[tuple[str, torch.Tensor]]:
        named = [("rng.cuda", torch.cuda.get_rng_state())] if torch.cuda.is_available() else []
        return named + [(f"rng.tracker.{key}", state) for key, state in sorted(self._tracker().get_states().items())]

    def set_device_rng_states(self, views: dict) -> None:
        if "rng.cuda" in views:
            torch.cuda.set_rng_state(views["rng.cuda"].clone())
        self._tracker().set_states({name[len("rng.tracker."):]: v.clone() for name, v in views.items()
                                    if name.startswith("rng.tracker.")})

    def host_meta(self) -> dict:
        meta = {"iteration": self.iteration}
        if self.scheduler is not None:
            meta["scheduler_steps"] = int(self.scheduler.num_steps)
        group_steps = [[int(g["step"]) if "step" in g else None for g in inner.param_groups]
                       for inner in self._inner_optimizers()]
        if any(v is not None for steps in group_steps for v in steps):
            # Transformer Engine's and Apex's FusedAdam (megatron-core's first choice where they are
            # installed) count steps per param group, not per parameter: the bias correction.
            meta["group_steps"] = group_steps
        return meta

    def _inner_optimizers(self) -> list:
        return [do.optimizer for do in distributed_optimizers(self.optimizer)]

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

    def apply_host_meta(self, meta: dict, views: dict) -> None:
        """The scheduler, the per-group step counts and the iteration count."""
        if self.scheduler is not None and "scheduler_steps" in meta:
            self.scheduler.num_steps = meta["scheduler_steps"]
            self.scheduler.step(0)  # the learning rate and weight decay of that step, into the param groups
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

    def has_optimizer_state(self) -> bool:
        return any(self._inner[id(p)].state.get(p) for _, p in self._shards)

    def set_optimizer_state(self, present: bool) -> None:
        """Create (one zero-gradient inner step at learning rate 0: the optimizer's own shapes and
        dtypes) or drop Adam's per-shard state; the restore overwrites every value."""
        for inner in {id(o): o for o in self._inner.values()}.values():
            params = [p for g in inner.param_groups for p in g["params"]]
            if present:
                zero_gradient_step(inner, params)
            else:
                for p in params:
                    inner.state.pop(p, None)

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
