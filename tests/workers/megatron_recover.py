"""Worker for tests/test_megatron_recover.py: the megatron-core GPT of mcore_gpt.py (PP=2 x DP=2,
1F1B, 4 microbatches, distributed Adam) trained through hotspare.integrations.megatron under
hotspare-run; one rank SIGKILLs itself mid-iteration.

Usage: megatron_recover.py OUT ITERS KILL, KILL = 'none' or 'RANK:ITER:MICRO:PHASE' with PHASE
forward (in the forward step of microbatch MICRO) or step (before the optimizer step). Each
process that finishes writes OUT/<worker id>.json: the last stage's losses by iteration, the
digest of its shards and Adam moments, the scheduler's count, its recoveries, and how many
collectives the main thread ran on a destroyed group after a rebuild (a tripwire on
torch.distributed's group check: a handle that was not re-pointed still works on gloo while
every old peer lives, so only this shows it).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading

import torch
from torch.distributed import distributed_c10d as c10d

import mcore_gpt
from hotspare.integrations import megatron
from hotspare.worker import worker_id
from hotspare_patches import megatron_core_cpu

STALE = [0]


def tripwire() -> None:
    original = c10d._rank_not_in_group

    def check(group):
        if (group is not None and group is not c10d.GroupMember.NON_GROUP_MEMBER
                and threading.current_thread() is threading.main_thread() and group not in c10d._world.pg_map):
            STALE[0] += 1
        return original(group)

    c10d._rank_not_in_group = check


def main(out: str, iters: int, kill: str) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    megatron_core_cpu.apply()
    tripwire()
    target = None
    if kill != "none":
        r, it, mb, phase = kill.split(":")
        target = (int(r), int(it), int(mb), phase)
    config = {"events_dir": os.path.join(out, "events"), "mirror": {"chunk_mb": 0.01, "timeout_s": 20.0},
              "recovery": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0, "collective_timeout_s": 30.0,
                           "rendezvous_timeout_s": 60.0}}
    session = megatron.initialize(lambda: mcore_gpt.build(gloo_groups=False), config,
                                  pipeline_model_parallel_size=mcore_gpt.PP)
    rank = session.generation.rank
    microbatch = [0]

    def due(it: int, mb: int, phase: str) -> bool:
        return target is not None and not session.spare and target == (rank, it, mb, phase)

    @session.resilient
    def train(it: int):
        microbatch[0] = 0

        def forward(data, model):
            if due(it, microbatch[0], "forward"):
                os.kill(os.getpid(), signal.SIGKILL)
            microbatch[0] += 1
            return mcore_gpt.forward_step(data, model)

        if due(it, 0, "step"):
            real_step = session.optimizer.step

            def step_then_die():
                os.kill(os.getpid(), signal.SIGKILL)
                return real_step()

            session.optimizer.step = step_then_die
        return mcore_gpt.train_iteration(session.model, session.optimizer, session.scheduler, it, forward=forward)

    losses = {}
    for it in session.steps(iters):
        loss = train(it)
        if loss is not None:
            losses[it] = loss
    from megatron.core import parallel_state as ps

    result = {"rank": rank, "worker": worker_id(), "spare": session.spare, "pp": ps.get_pipeline_model_parallel_rank(),
              "dp": ps.get_data_parallel_rank(), "losses": losses, "state": mcore_gpt.state_digest(session.optimizer),
              "sched_steps": session.scheduler.num_steps, "iteration": session.state.iteration,
              "recoveries": session.recoveries, "stale_group_calls": STALE[0]}
    session.close()
    with open(os.path.join(out, f"{worker_id()}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
