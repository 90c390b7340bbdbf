"""One replica group (one process) of the smoke GPT under torchft, as its users run it: a
``Manager`` on the group's own TCPStore and the job's Lighthouse, torchft's
``DistributedDataParallel`` and ``Optimizer`` wrappers, healing from a live peer over
``PGTransport`` (``recipes/bench_peers.py``, docs/peers.md). ``--plain``: the same loop on
torch's own DDP with no fault tolerance (the steady-state baseline).

    peer_torchft.py --config run.json --slot 1 --incarnation 0 [--plain]

run.json: ``model``, ``train`` (the job's), ``steps``, ``world``, ``kill_slot``, ``kill_step``,
``out_dir``, ``gloo_timeout_s``, ``min_replicas``. The environment: MASTER_ADDR, MASTER_PORT
(this group's store; plain: the job's), TORCHFT_LIGHTHOUSE.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from hotspare.testing.peers import Recorder, build, kill_me_here


def torchft_loop(run: dict, slot: int, incarnation: int, rec: Recorder) -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    class DDP(DistributedDataParallel):
        """torchft 0.2.0's comm hook asserts on the future of a failed allreduce (``assert
        fut._fut``): the error ``_ManagedWork.wait`` already reported to the Manager then ends
        every survivor with an AssertionError. The failed bucket's future is returned completed
        instead, so ``should_commit`` discards the step, as torchft means it to."""

        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            work.wait()
            fut = work.get_future()
            if getattr(fut, "_fut", None) is None:
                done = torch.futures.Future()
                done.set_result(bucket.buffer())
                return done
            return fut._fut

    # torchft's Manager joins its group's store as a client; torchrun would host it.
    torchft_loop.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True,
                                       wait_for_workers=False)
    model, base, sampler, loss_of = build(run)
    timeout = datetime.timedelta(seconds=run["gloo_timeout_s"])
    pg = ProcessGroupGloo(timeout=timeout)

    def state_dict():
        return {"model": model.state_dict(), "optim": base.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        base.load_state_dict(sd["optim"])
        rec("healed")

    manager = Manager(pg=pg, min_replica_size=run["min_replicas"], load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"bench_peers_{slot}", hostname="127.0.0.1",
                      lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], timeout=datetime.timedelta(seconds=10),
                      quorum_timeout=datetime.timedelta(seconds=60), connect_timeout=datetime.timedelta(seconds=10),
                      checkpoint_transport=PGTransport(pg, timeout=datetime.timedelta(seconds=10),
                                                       device=torch.device("cpu")),
                      init_sync=False)  # the same seed everywhere: no start-up transfer
    ddp, optimizer = DDP(manager, model), Optimizer(manager, base)
    rec("ready")
    if incarnation == 0:  # the first quorum with all replicas (torchrun's rendezvous would wait too)
        while not all(os.path.exists(os.path.join(run["out_dir"], f"ready{s}")) for s in range(run["world"])):
            open(os.path.join(run["out_dir"], f"ready{slot}"), "w").close()
            time.sleep(0.02)
    while manager.current_step() < run["steps"]:
        step = manager.current_step()
        optimizer.zero_grad()  # starts the quorum
        if incarnation == 0 and slot == run["kill_slot"] and step == run["kill_step"]:
            manager.wait_quorum()  # the step's quorum includes the victim: its peers wait on it
        kill_me_here(rec, run, slot, step, incarnation)
        tokens, targets = sampler.batch(step, slot)
        loss = loss_of(ddp, tokens, targets)
        loss.backward()
        committed = manager.should_commit()  # what torchft's Optimizer.step asks, asked here to record it
        if committed:
            base.step()
        rec.step(step, committed, manager.num_participants(), manager.is_participating(), loss.item())
    rec("done", step=manager.current_step())
    manager.shutdown(wait=False)


def plain_loop(run: dict, slot: int, rec: Recorder) -> None:
    dist.init_process_group("gloo", rank=slot, world_size=run["world"], timeout=datetime.timedelta(seconds=60))
    model, optimizer, sampler, loss_of = build(run)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for step in range(run["steps"]):
        optimizer.zero_grad()
        tokens, targets = sampler.batch(step, slot)
        loss = loss_of(ddp, tokens, targets)
        loss.backward()
        optimizer.step()
        rec.step(step, True, run["world"], True, loss.item())
    rec("done", step=run["steps"])
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    with open(a.config, encoding="utf-8") as f:
        run = json.load(f)
    rec = Recorder(run["out_dir"], a.slot, a.incarnation)
    rec("started")
    if a.plain:
        plain_loop(run, a.slot, rec)
    else:
        torchft_loop(run, a.slot, a.incarnation, rec)
    os._exit(0)  # torchft's threads (its Manager server, the quorum) do not stop the process


if __name__ == "__main__":
    main()
