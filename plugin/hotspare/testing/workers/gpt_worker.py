"""One rank of the GPT smoke job: an ordinary DeepSpeed training loop started through hotspare.

Started by hotspare-run (see recipes/train_gpt.py) with ``--config RUN.json``; writes
``rank<R>.json`` (per-step losses as float hex, digests of its fp32 partition and optimizer
state, timings, recoveries) into the run's output directory. Rank 0 prints progress.

The loop is written with ``session.resilient`` / ``session.steps``: a failed peer is replaced
in place and the interrupted step runs again. ``fault`` in run.json (``{"rank": R, "step":
S}``) SIGKILLs rank R before the forward of step S, once, and records when in fault.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import os
import signal
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

import hotspare
from hotspare.env import make_deterministic
from hotspare.integrations.deepspeed import fp32_partitions, optimizer_state_tensors
from hotspare.snapshot import read_meta
from hotspare.testing import digest, statedigest
from hotspare.testing.data import ByteSampler, load_corpus
from hotspare.testing import hf
from hotspare.testing.gpt import GPTConfig
from hotspare.worker import worker_id



def snapshot_digest(layout, buf) -> str:
    """Digest of a mirrored snapshot: its tensor segments and its metadata."""
    h = hashlib.sha256(digest(layout.views(buf)).encode())
    h.update(json.dumps(read_meta(buf, layout), sort_keys=True).encode())
    return h.hexdigest()


def live_digest(state) -> str:
    """The same digest computed from the live engine state (not from any copy of it)."""
    h = hashlib.sha256(digest(t for _, t in state.tensors()).encode())
    h.update(json.dumps(json.loads(json.dumps(state.meta())), sort_keys=True).encode())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    run = json.load(open(ap.parse_args().config, encoding="utf-8"))
    train, out_dir = run["train"], run["out_dir"]
    make_deterministic(train["seed"])
    import deepspeed.utils

    # DeepSpeed's own start-up chatter (scheduler queried before its first step, deprecated
    # torch collective names) is not the user's concern in this recipe.
    deepspeed.utils.logger.setLevel("ERROR")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    model_cfg = GPTConfig(**run["model"])
    model, loss_of = hf.model_and_loss(model_cfg)
    num_params = sum(p.numel() for p in model.parameters())
    session = hotspare.initialize(model=model, config=run["deepspeed"], model_parameters=model.parameters(),
                                  collective_timeout_s=run.get("collective_timeout_s", 120.0),
                                  data_state=hotspare.STEP_INDEXED)  # ByteSampler: a batch is a function of the step
    engine = session.engine
    rank, world = session.generation.rank, session.generation.world_size
    micro_bs, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    sampler = ByteSampler(load_corpus(run.get("corpus", "")), model_cfg.seq_len, micro_bs, seed=train["seed"])
    tokens_per_step = world * micro_bs * accum * model_cfg.seq_len
    if rank == 0 and not session.spare:
        print(f"{model_cfg.family} {num_params:,} params | ZeRO-{engine.zero_optimization_stage()} | {world} ranks | "
              f"{tokens_per_step} tokens/step", flush=True)

    verify = run.get("verify_mirror", False)
    block = run.get("mirror_block", 0)
    own_digests, held_digests, mirrored = {}, [], {}
    # By step: a step run again after a recovery overwrites what its first run left.
    losses, step_times, step_end = {}, {}, {}
    fault = run.get("fault") or {}
    window = {"t0": time.perf_counter(), "steps": 0}

    @session.resilient
    def train_step(step: int) -> None:
        mirror = session.mirror  # a recovery starts a new one
        if mirror is not None and block:
            # Alternate blocks of steps with mirroring off and on (same process, same data).
            mirror.enabled = (step // block) % 2 == 1
        mirrored[step] = mirror is not None and mirror.enabled
        t0 = time.perf_counter()
        for micro in range(accum):
            if fault.get("rank") == rank and fault.get("step") == step and worker_id() == f"a{rank}":
                with open(os.path.join(out_dir, "fault.json"), "w", encoding="utf-8") as f:
                    json.dump({"t": time.monotonic(), "rank": rank, "step": step}, f)
                os.kill(os.getpid(), signal.SIGKILL)
            tokens, targets = sampler.batch(step * accum + micro, rank)
            loss = loss_of(engine, tokens, targets)
            engine.backward(loss)
            engine.step()
        step_times[step] = time.perf_counter() - t0
        step_end[step] = time.monotonic()
        if session.events is not None:  # for the recipe's timeline plot
            session.events("step", version=step, seconds=step_times[step], worker=worker_id())
        losses[step] = loss.item()
        if verify and mirror is not None:
            own_digests[engine.global_steps] = live_digest(session.state)
            for src in mirror.sources:
                version, buf = mirror.read_committed(src)
                # Version 0 (before the first step) has no optimizer state: another layout.
                if buf is not None and buf.numel() == mirror.layout.nbytes:
                    held_digests.append([src, version, snapshot_digest(mirror.layout, buf)])
        window["steps"] += 1
        if (step + 1) % train["log_interval"] == 0 or step + 1 == train["steps"]:
            # The window's mean loss from the per-step record: exact after a step ran twice. A spare
            # has only the steps from where it landed: sum and count travel together.
            first = step - step % train["log_interval"]
            mine = [losses[s] for s in range(first, step + 1) if s in losses]
            window_loss = torch.tensor([sum(mine), len(mine)], dtype=torch.float64)
            dist.all_reduce(window_loss)  # inside the step: a peer lost here is recovered too
            elapsed = time.perf_counter() - window["t0"]
            if rank == 0:
                print(f"step {step + 1:5d} | loss {window_loss[0].item() / window_loss[1].item():.4f} | "
                      f"{tokens_per_step * window['steps'] / elapsed:,.0f} tokens/s", flush=True)
            window.update(t0=time.perf_counter(), steps=0)

    for step in session.steps(train["steps"]):
        train_step(step)

    mirror = session.mirror
    mirror_result = None
    if mirror is not None:
        mirror.enabled = True
        committed = mirror.flush()
        mirror_result = {**mirror.summary(), "global_committed": committed,
                         "unique_bytes_per_param": session.state.bytes_per_param(),
                         "own_digests": own_digests, "held_digests": held_digests}
        if verify:
            own_digests[committed] = live_digest(session.state)
            for src in mirror.sources:
                version, buf = mirror.read_committed(src)
                held_digests.append([src, version, snapshot_digest(mirror.layout, buf)])
    steps = range(train["steps"])
    result = {
        "rank": rank, "worker": worker_id(), "spare": session.spare, "world_size": world,
        "zero_stage": engine.zero_optimization_stage(), "steps": train["steps"],
        "losses_hex": [float(losses[s]).hex() for s in steps if s in losses],
        "losses": [losses[s] for s in steps if s in losses], "first_step": min(losses, default=0),
        "fp32_digest": digest(fp32_partitions(engine)),
        "optimizer_digest": digest(t for _, t in optimizer_state_tensors(engine)),
        "state_digest": statedigest.deepspeed_engine(engine),
        "fp32_numel": sum(p.numel() for p in fp32_partitions(engine)),
        "num_params": num_params, "tokens_per_step": tokens_per_step,
        "step_s_median": statistics.median(step_times.values()), "total_s": sum(step_times.values()),
        "step_times": [step_times[s] for s in steps if s in step_times],
        "step_end": {str(s): t for s, t in step_end.items()},
        "mirrored_steps": [mirrored[s] for s in steps if s in mirrored], "mirror": mirror_result,
        "recoveries": session.recoveries,
    }
    session.close()
    result["threads_after_close"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("hotspare"))
    result["process_group_after_close"] = dist.is_initialized()
    tmp = os.path.join(out_dir, f".rank{rank}.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
