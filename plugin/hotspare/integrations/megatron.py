"""megatron-core: the unique state of one rank of a pipeline-parallel x data-parallel job.

Issue 6 in progress: this module holds what the mirror, keeper and restore need from a
megatron-core rank (the razor, as :class:`hotspare.integrations.deepspeed.DeepSpeedState` does
for ZeRO); the recovery wiring (the ``parallel_state`` groups rebuilt in place, the pipeline
schedule resumed) is not built yet.

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

import random

import numpy as np
import torch

from ..snapshot import Layout, read_meta

SUPPORTED_MEGATRON = ("0.16.",)


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
        for kind, groups in (("fp32", do.shard_fp32_groups), ("main", do.shard_fp32_from_float16_groups)):
            for g, group in enumerate(groups):
                out += [(f"{kind}.{i}.{g}.{j}", p) for j, p in enumerate(group)]
    return out


class MegatronState:
    """The unique state of one megatron-core rank, in the contract the mirror and the restore use
    (``tensors``, ``meta``, ``restore``, ``resync``)."""

    def __init__(self, model_chunks: list, optimizer, scheduler=None, data_state=None, load_data_state=None):
        self.model_chunks, self.optimizer, self.scheduler = list(model_chunks), optimizer, scheduler
        self.data_state, self.load_data_state = data_state, load_data_state
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
        meta = {"rng_python": {"version": py[0], "gauss_next": py[2]},
                "rng_numpy": {"kind": nps[0], "pos": int(nps[2]), "has_gauss": int(nps[3]),
                              "cached_gaussian": float(nps[4])}}
        if self.scheduler is not None:
            meta["scheduler_steps"] = int(self.scheduler.num_steps)
        if self.data_state is not None:
            meta["data"] = self.data_state()
        return meta

    def restore(self, buf: torch.Tensor, layout: Layout) -> None:
        """Put snapshot ``buf`` back: shards and optimizer state in place (every alias sees
        them), RNG states, the scheduler, the data position. :meth:`resync` must follow."""
        live = self.tensors()
        if not layout.matches(live):
            raise RuntimeError(f"the snapshot's layout ({layout.nbytes} bytes, {len(layout.segments)} tensors) is not "
                               f"this rank's ({Layout.of(live).nbytes} bytes, {len(live)} tensors): the spare's model "
                               f"or optimizer differs from the rank it replaces")
        views = {seg.name: v for seg, v in zip(layout.segments, layout.views(buf))}
        meta = read_meta(buf, layout)
        with torch.no_grad():
            for name, tensor in live:
                if not name.startswith("rng."):
                    tensor.copy_(views[name])
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

    def resync(self) -> None:
        """Every data-parallel rank all-gathers its stage's weights from the restored shards
        (collective) and drops the interrupted iteration's gradients."""
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=True)
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
