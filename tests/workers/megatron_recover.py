"""Worker for tests/test_megatron_recover.py: the megatron-core GPT of mcore_gpt.py (PP=2 x DP=2,
or PP=2 x TP=2 with HS_TEST_TP=2, interleaved over 2 virtual stages with HS_TEST_VP=2; 1F1B, 4 microbatches, distributed Adam) trained through hotspare.integrations.megatron under
hotspare-run; one rank SIGKILLs itself mid-iteration.

Usage: megatron_recover.py OUT ITERS KILL [CKPT_EVERY], KILL = 'none' or comma-separated
'RANK:ITER:MICRO:PHASE' with PHASE forward (in the forward step of microbatch MICRO), step
(before the optimizer step) or start (before the iteration's first collective; every 'start'
target of that iteration waits for the others there, so they die together: a rank and its only
mirror holder). CKPT_EVERY > 0: persistent checkpoints every that many iterations. Each
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
import time

import torch
from torch.distributed import distributed_c10d as c10d

import mcore_gpt
import hotspare
from hotspare.integrations import megatron
from hotspare.testing import statedigest
from hotspare.testing.groups import dead_groups_held
from hotspare.worker import worker_id
from hotspare_patches import megatron_core_cpu

STALE = [0]
TP = int(os.environ.get("HS_TEST_TP", "1"))
"""Tensor-parallel size (HS_TEST_TP): 2 makes the 4 ranks PP=2 x TP=2 x DP=1."""
VP = int(os.environ.get("HS_TEST_VP", "1"))
"""Virtual pipeline size (HS_TEST_VP): 2 gives each stage two chunks of one layer, run by the
interleaved 1F1B schedule."""
GLOO_GROUPS = os.environ.get("HS_TEST_GLOO_GROUPS") == "1"
"""megatron-core's extra gloo data-parallel groups for the distributed optimizer
(``use_gloo_process_groups``, its default on a GPU install)."""


def tripwire() -> None:
    original = c10d._rank_not_in_group

    def check(group):
        if (group is not None and group is not c10d.GroupMember.NON_GROUP_MEMBER
                and threading.current_thread() is threading.main_thread() and group not in c10d._world.pg_map):
            STALE[0] += 1
        return original(group)

    c10d._rank_not_in_group = check


def main(out: str, iters: int, kill: str, ckpt_every: int = 0) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    megatron_core_cpu.apply()
    tripwire()
    targets = set()
    if kill != "none":
        for spec in kill.split(","):
            r, it, mb, phase = spec.split(":")
            targets.add((int(r), int(it), int(mb), phase))
    config = {"events_dir": os.path.join(out, "events"), "mirror": {"chunk_mb": 0.01, "timeout_s": 20.0},
              "recovery": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0, "collective_timeout_s": 30.0,
                           "rendezvous_timeout_s": 60.0}}
    if ckpt_every:
        config["checkpoint"] = {"dir": os.path.join(out, "ckpt"), "every": ckpt_every, "keep": 2}
    session = megatron.initialize(lambda: mcore_gpt.build(gloo_groups=GLOO_GROUPS), config,
                                  pipeline_model_parallel_size=mcore_gpt.PP, tensor_model_parallel_size=TP,
                                  virtual_pipeline_model_parallel_size=VP if VP > 1 else None,
                                  create_gloo_process_groups=GLOO_GROUPS, data_state=hotspare.STEP_INDEXED)
    rank = session.generation.rank
    microbatch = [0]

    def due(it: int, mb: int, phase: str) -> bool:
        return not session.spare and (rank, it, mb, phase) in targets

    def die_together(it: int) -> None:
        """Every 'start' target of iteration ``it`` says it is here, waits for the others, then dies."""
        together = sorted(t[0] for t in targets if t[1] == it and t[3] == "start")
        open(os.path.join(out, f"start.{it}.{rank}"), "w").close()
        deadline = time.monotonic() + 30
        while not all(os.path.exists(os.path.join(out, f"start.{it}.{r}")) for r in together):
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {together} did not all reach iteration {it}")
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    @session.resilient
    def train(it: int):
        microbatch[0] = 0
        if due(it, 0, "start"):
            die_together(it)

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
              "dp": ps.get_data_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
              "tp_size": ps.get_tensor_model_parallel_world_size(), "chunks": len(session.model), "losses": losses, "state": statedigest.megatron(session.model, session.optimizer, session.scheduler),
              "sched_steps": session.scheduler.num_steps, "iteration": session.state.iteration,
              "recoveries": session.recoveries, "stale_group_calls": STALE[0],
              "dead_groups_held": dead_groups_held()}
    session.close()
    with open(os.path.join(out, f"{worker_id()}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *(int(a) for a in sys.argv[4:5]))
