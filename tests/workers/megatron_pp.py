"""Worker for tests/test_megatron_pipeline.py: megatron-core 0.16.1 on CPU/gloo through the shim,
PP=2 x DP=2 (4 ranks started by hotspare-run), megatron-core's GPTModel (local layer spec, tied
embeddings) split into two stages, megatron-core DDP and the distributed optimizer (Adam),
the 1F1B schedule with 4 microbatches, a cosine OptimizerParamScheduler.

Usage: megatron_pp.py OUT ITERS [ROUNDTRIP]. With ROUNDTRIP = i >= 0, every rank snapshots its
unique state (hotspare.integrations.megatron.MegatronState, into a snapshot buffer as the mirror
does) after iteration i, runs iteration i+1, wrecks its shards, Adam moments, scheduler and RNG,
restores the snapshot and runs iteration i+1 again. Writes OUT/rank<R>.json: per-iteration
losses (last stage; a replay overwrites), the digest of the rank's state from megatron-core's
own view (hotspare.testing.statedigest.megatron), the scheduler's step count.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import mcore_gpt
from hotspare import env
from hotspare.generation import Generation, join, store_from_env
from hotspare.integrations.megatron import MegatronState, check_version, distributed_optimizers
from hotspare.snapshot import Layout, write_meta
from hotspare.testing import statedigest
from hotspare_patches import megatron_core_cpu


def main(out: str, iters: int, roundtrip: int = -1) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    megatron_core_cpu.apply()
    check_version()
    from megatron.core import parallel_state as ps

    rank, world = env.env_int("RANK", 0), env.env_int("WORLD_SIZE", 1)
    join(store_from_env(), Generation(0, rank, world), "gloo", 60.0)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=mcore_gpt.PP)
    [model], optimizer, sched = mcore_gpt.build()
    state = MegatronState([model], optimizer, sched)
    losses, snapshot, replayed = {}, None, False
    it = -1
    while it + 1 < iters:
        it += 1
        if roundtrip >= 0 and it == roundtrip + 1 and snapshot is None:
            named = state.tensors()
            layout = Layout.of(named)
            snapshot = layout.allocate()
            for view, (_, t) in zip(layout.views(snapshot), named):
                view.copy_(t.reshape(-1))
            write_meta(snapshot, layout, state.meta())
        elif roundtrip >= 0 and it == roundtrip + 2 and not replayed:
            replayed = True
            with torch.no_grad():  # wreck everything the snapshot must bring back
                for do in distributed_optimizers(optimizer):
                    for group in do.optimizer.param_groups:
                        for p in group["params"]:
                            p.add_(1.0)
                            for v in do.optimizer.state[p].values():
                                v.mul_(3.0)
            sched.step(12345)
            torch.manual_seed(999)
            # As from the keeper's device copy: the tensors from a second buffer, the metadata and
            # RNG states from the first, whose other tensors are wrecked (they must not be read).
            on_device = snapshot.clone()
            for seg, view in zip(layout.segments, layout.views(snapshot)):
                if not seg.name.startswith("rng."):
                    view.fill_(7)
            state.restore(snapshot, layout, tensors_from=on_device)
            state.resync()
            it = roundtrip + 1
        loss = mcore_gpt.train_iteration([model], optimizer, sched, it)
        if loss is not None:
            losses[it] = loss
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "pp": ps.get_pipeline_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
                   "losses": losses, "state": statedigest.megatron([model], optimizer, sched), "sched_steps": sched.num_steps,
                   "redirects": megatron_core_cpu.redirects()}, f)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else -1)
