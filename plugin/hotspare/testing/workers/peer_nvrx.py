"""One process of the smoke GPT under NVIDIA's in-process restart (nvidia-resiliency-ext's
``inprocess.Wrapper``), as its usage guide has it: the training function wrapped, a process
group made per restart iteration on a prefix of the job's store, model and optimizer kept outside
the function so the survivors keep them, and one reserve process (world 5, 4 active:
``MaxActiveWorldSize(4)`` after ``FillGaps``, so the reserve takes the dead rank's place). NVRx
moves no training state; the reserve gets it from the new rank 0 by broadcast
(``recipes/bench_peers.py``, docs/peers.md).

    peer_nvrx.py --config run.json      # RANK, WORLD_SIZE (5), MASTER_ADDR, MASTER_PORT set

run.json: ``model``, ``train``, ``steps``, ``world`` (active ranks), ``kill_slot``,
``kill_step``, ``out_dir``, ``gloo_timeout_s``. Ports: MASTER_PORT (the Wrapper's store),
MASTER_PORT + 1 (the job's).
"""

import argparse  # no "from __future__ import annotations": the Wrapper reads the CallWrapper annotation at run time
import datetime
import json
import os
from typing import Optional

import torch
import torch.distributed as dist

from hotspare.testing.peers import Recorder, build, kill_me_here


def main() -> None:
    import nvidia_resiliency_ext.inprocess as inprocess
    from nvidia_resiliency_ext.inprocess.rank_assignment import FillGaps, MaxActiveWorldSize

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    a = p.parse_args()
    with open(a.config, encoding="utf-8") as f:
        run = json.load(f)
    initial = int(os.environ["RANK"])
    port = int(os.environ["MASTER_PORT"])
    rec = Recorder(run["out_dir"], initial, 0, name=f"p{initial}")
    rec("started")
    model, optimizer, sampler, loss_of = build(run)  # outside the wrapped function: a survivor keeps them
    progress = {"step": 0}
    seconds = lambda s: datetime.timedelta(seconds=s)  # noqa: E731
    store = dist.TCPStore(os.environ["MASTER_ADDR"], port + 1, world_size=int(os.environ["WORLD_SIZE"]),
                          is_master=initial == 0, multi_tenant=True, wait_for_workers=True)

    @inprocess.Wrapper(store_kwargs={"port": port}, rank_assignment=inprocess.Compose(
                           MaxActiveWorldSize(run["world"]), FillGaps()),
                       monitor_thread_interval=seconds(0.2), monitor_process_interval=seconds(0.2),
                       progress_watchdog_interval=seconds(0.2), heartbeat_interval=seconds(0.5),
                       heartbeat_timeout=seconds(5), soft_timeout=seconds(15), hard_timeout=seconds(25),
                       barrier_timeout=seconds(60), completion_timeout=seconds(60), last_call_wait=seconds(0.2),
                       termination_grace_time=seconds(2),
                       monitor_process_logfile=os.path.join(os.path.abspath(run["out_dir"]), "monitor_{rank}.log"))
    def train(call_wrapper: Optional[inprocess.CallWrapper] = None):
        it = call_wrapper.iteration
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by the Wrapper
        rec.slot, rec.incarnation = rank, it
        rec("iteration", it=it, rank=rank, monitor_pid=call_wrapper.monitor_process.process_monitor_proc.pid)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"it{it}", store), rank=rank, world_size=size,
                                timeout=seconds(run["gloo_timeout_s"]))
        if it > 0:  # the reserve has no trained state: rank 0 (a survivor) sends its own
            state = [{"model": model.state_dict(), "optim": optimizer.state_dict(), "step": progress["step"]}
                     if rank == 0 else None]
            dist.broadcast_object_list(state, src=0)
            if rank != 0:
                model.load_state_dict(state[0]["model"])
                optimizer.load_state_dict(state[0]["optim"])
                progress["step"] = state[0]["step"]
            rec("synced", step=progress["step"])
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        while progress["step"] < run["steps"]:
            step = progress["step"]
            kill_me_here(rec, run, rank, step, it)  # the process of rank kill_slot, in the first iteration
            optimizer.zero_grad()
            tokens, targets = sampler.batch(step, rank)
            loss = loss_of(ddp, tokens, targets)
            loss.backward()
            optimizer.step()
            progress["step"] = step + 1
            rec.step(step, True, size, True, loss.item())
        dist.destroy_process_group()

    train()
    rec("done", step=progress["step"])
    os._exit(0)


if __name__ == "__main__":
    main()
