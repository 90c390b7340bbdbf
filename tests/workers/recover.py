"""Worker for tests/test_recover.py: a ZeRO engine trained with ``session.resilient`` under
hotspare-run; one rank SIGKILLs itself at a chosen (step, micro-batch, phase).

Usage: recover.py STAGE OUT KILL ACCUM STEPS [CKPT_EVERY], KILL = 'none' or 'RANK:STEP:MICRO:PHASE' (or
several joined by ','), PHASE one of forward, backward, step, mirror, later (SIGKILL 1 s after the forward
begins), hang (SIGSTOP), wedge (the training thread stops for good, the heartbeat goes on), transient (raise a collective timeout once; nobody dies),
join (die while arriving in generation 1, i.e. during the first recovery; STEP is ignored),
write (die in the middle of writing the step's snapshot into the keeper's segment: after 2 of its
segments), seal (die after the write, between the seal records of chunks 0 and 1), commit0 (die after the
seal, before the first chunk's checksum), commit1 (die between the checksums of chunks 0 and 1), corrupt (after the step's copies are out, flip a byte of every version the
keeper holds, then die: the spare must not use them), node (the whole logical node is lost: its spares and
its keeper are killed, then this rank). HS_TEST_TIER2=stripe:K:M makes tier 2 a zfec stripe. Each process that
finishes writes OUT/<worker id>.json: the losses by step, final digests, its recoveries.
CKPT_EVERY > 0 saves a persistent checkpoint into OUT/ckpt every that many steps.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import sys
import threading
import time

import torch

import hotspare
from hotspare import faults as fault_points
from hotspare.integrations.deepspeed import fp32_partitions, optimizer_state_tensors
from hotspare.testing import statedigest
from hotspare.testing.groups import dead_groups_held
from hotspare.control.keys import spare_id
from hotspare.worker import worker_id
from tiny import batch, initialize_kwargs, loss_of, tiny_model_and_config


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


KEEPER_FAULTS = {"write": ("snapshot_write", 2), "seal": ("keeper_seal", 1), "commit0": ("keeper_commit", 0),
                 "commit1": ("keeper_commit", 1)}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def wait_for_spares(session) -> None:
    """Before a test's first fault: every spare the launcher starts (HS_TEST_SPARES =
    "nodes:per_node") is ready. A failure before a spare of the dead rank's own node is ready is
    taken by a ready spare of another node, whose keeper holds nothing of the rank: the run is
    right, but not the takeover the test checks (seen on a loaded CI machine at step 2)."""
    nodes, per_node = (int(x) for x in os.environ.get("HS_TEST_SPARES", "0:0").split(":"))
    wanted = [spare_id(n, k) for n in range(nodes) for k in range(per_node)]
    deadline = time.monotonic() + 120
    while not all(session.control.is_ready(w) for w in wanted):
        if time.monotonic() > deadline:
            raise RuntimeError(f"spares {wanted} not all ready after 120 s")
        time.sleep(0.05)


def main(stage: int, out: str, kill: str, accum: int, steps: int, ckpt_every: int = 0) -> None:
    model, ds = tiny_model_and_config(stage, lr=1e-2, gradient_accumulation_steps=accum)
    ds["zero_optimization"]["reduce_bucket_size"] = 2048  # several buckets: reductions run mid-backward
    ds["hotspare"] = {
        "events_dir": os.path.join(out, "events"),
        "mirror": {"chunk_mb": 0.01, "timeout_s": 20.0},
        "recovery": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0,
                     "collective_timeout_s": float(os.environ.get("HS_TEST_COLLECTIVE_TIMEOUT_S", "30")),
                     "rendezvous_timeout_s": float(os.environ.get("HS_TEST_RENDEZVOUS_TIMEOUT_S", "60"))},
    }
    if os.environ.get("HS_TEST_TIER2", "").startswith("stripe"):
        _, k, m = os.environ["HS_TEST_TIER2"].split(":")
        ds["hotspare"]["retain"] = {"tier2": "stripe", "k": int(k), "m": int(m)}
    if ckpt_every:
        ds["hotspare"]["checkpoint"] = {"dir": os.path.join(out, "ckpt"), "every": ckpt_every}
    if any(spec.endswith(":join") and spec.split(":")[0] == os.environ.get("RANK") for spec in kill.split(",")) \
            and worker_id() == f"a{os.environ.get('RANK')}":
        fault_points.arm("join", at=1)  # a second failure while the first recovery's generation forms
    session = hotspare.initialize(model=model, config=ds, **initialize_kwargs(model, 1e-2),
                                  data_state=hotspare.STEP_INDEXED)
    engine, rank, wid = session.engine, session.generation.rank, worker_id()
    faults = {}
    for spec in ([] if kill == "none" else kill.split(",")):
        r, s, m, phase = spec.split(":")
        faults[(int(r), int(s), int(m))] = phase
    if faults and wid == f"a{rank}":
        wait_for_spares(session)
    losses: dict[int, str] = {}
    transient_done: list = []

    def fault(step: int, micro: int) -> str:
        # Only the process that started as the rank dies; a spare that takes it does not.
        return faults.get((rank, step, micro), "") if wid == f"a{rank}" and not transient_done else ""

    def die_together(step: int, micro: int, phase: str) -> None:
        """Ranks given the same (step, micro-batch, phase) die together: each waits until all
        of them got there (else the first death's recovery may land before the others reach
        their point, and they die in another step)."""
        together = [r for (r, s, m), p in faults.items() if (s, m, p) == (step, micro, phase)]
        if len(together) > 1:
            key = f"test/die/{step}/{micro}/{phase}"
            session.store.add(key, 1)
            deadline = time.monotonic() + 60
            while session.store.add(key, 0) < len(together) and time.monotonic() < deadline:
                time.sleep(0.001)
        die()

    def die_after_others(step: int) -> None:
        others = [f"test/stepped/{step}/{r}" for r in range(session.generation.world_size) if r != rank]
        deadline = time.monotonic() + 60
        while not session.store.check(others) and time.monotonic() < deadline:
            time.sleep(0.001)
        die()

    @session.resilient
    def train_step(step: int):
        for micro in range(accum):
            tokens = batch(step, rank, micro)
            phase = fault(step, micro)
            if phase == "forward":
                die_together(step, micro, phase)
            if phase == "later":
                # Dies 1 s from here, wherever it is then (blocked in this step's collectives on a
                # peer that wedged, say).
                threading.Timer(1.0, die).start()
            if phase == "node":
                fault_points.lose_node()
            if phase == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)  # hung: its launcher sees no heartbeat and kills it
            if phase == "wedge":
                while True:  # stuck outside any collective; the heartbeat thread keeps beating
                    time.sleep(0.05)
            if phase == "transient" and not transient_done:
                transient_done.append(1)
                raise RuntimeError("Timed out waiting 1000ms for recv operation to complete (injected)")
            if phase == "backward":
                # Dies when the gradient reaches the first block's output: the buckets of the
                # layers after it are reduced already, the rest not.
                def arm(_module, _inputs, out):
                    out.register_hook(lambda _grad: die())

                handle = engine.module.blocks[0].register_forward_hook(arm)
            loss = loss_of(engine, tokens)
            if phase == "mirror":
                mirror = session.mirror
                send, sent = mirror.transport.send, []

                def send_then_die(tensor, dst, tag):
                    sent.append(1)
                    if len(sent) == 4:  # header and two chunks of the next version are out
                        die()
                    return send(tensor, dst, tag)

                mirror.transport.send = send_then_die
            engine.backward(loss)
            if phase == "backward":
                handle.remove()
            if phase == "step":
                die()
            if phase in KEEPER_FAULTS:
                # Fires inside engine.step's capture or its mirror round. In the round (off the
                # training thread), it fires once every other rank has taken the step: else a
                # slow rank may not have its snapshot of the step yet, and the job lands on the
                # version before (right, but not the case the test is for).
                action = functools.partial(die_after_others, step) if phase.startswith("commit") else "kill"
                fault_points.arm(*KEEPER_FAULTS[phase], action=action)
            engine.step()
            if faults:  # a spare that took a rank over writes it too
                session.store.set(f"test/stepped/{step}/{rank}", b"1")
            if phase == "corrupt":
                session.mirror.flush()  # this step's round (commit records, copies to peers) is complete
                segment = session.mirror.snapshots.segment
                for slot in segment.slots:
                    slot[len(slot) // 2] ^= 0xFF
                die()
        losses[step] = float(loss).hex()
        return loss

    for step in session.steps(steps):
        train_step(step)
    result = {"rank": rank, "worker": wid, "losses": losses, "fp32": digest(fp32_partitions(engine)),
              "optim": digest(t for _, t in optimizer_state_tensors(engine)), "global_steps": engine.global_steps,
              "state": statedigest.deepspeed_engine(engine), "recoveries": session.recoveries, "spare": session.spare}
    result["dead_groups_held"] = dead_groups_held()
    session.close()
    result["threads_after_close"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("hotspare"))
    result["process_group_after_close"] = torch.distributed.is_initialized()
    with open(os.path.join(out, f"{wid}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
         int(sys.argv[6]) if len(sys.argv) > 6 else 0)
