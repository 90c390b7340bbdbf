"""One rank of the GPT smoke job: an ordinary DeepSpeed training loop started through hotspare.

Started by hotspare-run (see recipes/train_gpt.py) with ``--config RUN.json``; writes
``rank<R>.json`` (per-step losses as float hex, digests of its fp32 partition and optimizer
state, timings) into the run's output directory. Rank 0 prints progress.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
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
from hotspare.testing.data import ByteSampler, load_corpus
from hotspare.testing.gpt import GPT, GPTConfig


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
    model = GPT(GPTConfig(**run["model"]))
    session = hotspare.initialize(model=model, config=run["deepspeed"], model_parameters=model.parameters(),
                                  collective_timeout_s=run.get("collective_timeout_s", 120.0))
    engine = session.engine
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_bs, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    sampler = ByteSampler(load_corpus(run.get("corpus", "")), model.cfg.seq_len, micro_bs, seed=train["seed"])
    tokens_per_step = world * micro_bs * accum * model.cfg.seq_len
    if rank == 0:
        print(f"GPT {model.num_params():,} params | ZeRO-{engine.zero_optimization_stage()} | {world} ranks | "
              f"{tokens_per_step} tokens/step", flush=True)

    mirror, verify = session.mirror, run.get("verify_mirror", False)
    block = run.get("mirror_block", 0)
    own_digests, held_digests, mirrored_steps = {}, [], []
    losses, step_times = [], []
    window_loss, window_t0 = torch.zeros(()), time.perf_counter()
    for step in range(train["steps"]):
        if mirror is not None and block:
            # Alternate blocks of steps with mirroring off and on (same process, same data).
            mirror.enabled = (step // block) % 2 == 1
        mirrored_steps.append(mirror is not None and mirror.enabled)
        t0 = time.perf_counter()
        for micro in range(accum):
            tokens, targets = sampler.batch(step * accum + micro, rank)
            loss = engine(tokens.to(engine.device), targets.to(engine.device))
            engine.backward(loss)
            engine.step()
        step_times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if verify and mirror is not None:
            own_digests[engine.global_steps] = live_digest(session.state)
            for src in mirror.sources:
                version, buf = mirror.read_committed(src)
                # Version 0 (before the first step) has no optimizer state: another layout.
                if buf is not None and buf.numel() == mirror.layout.nbytes:
                    held_digests.append([src, version, snapshot_digest(mirror.layout, buf)])
        window_loss += loss.detach().float().cpu()
        if (step + 1) % train["log_interval"] == 0 or step + 1 == train["steps"]:
            n = (step % train["log_interval"]) + 1
            dist.all_reduce(window_loss)
            elapsed = time.perf_counter() - window_t0
            if rank == 0:
                print(f"step {step + 1:5d} | loss {window_loss.item() / (world * n):.4f} | "
                      f"{tokens_per_step * n / elapsed:,.0f} tokens/s", flush=True)
            window_loss.zero_()
            window_t0 = time.perf_counter()

    mirror_result = None
    if mirror is not None:
        mirror.enabled = True
        committed = mirror.flush()
        st = mirror.stats
        mirror_result = {
            "holders": mirror.holders, "sources": mirror.sources, "global_committed": committed,
            "rounds": st.rounds, "waits": st.waits, "skips": st.skips, "bytes_sent": st.bytes_sent,
            "commit_failures": st.commit_failures, "wait_s": st.wait_s, "capture_s": st.capture_s,
            "snapshot_bytes": mirror.layout.nbytes if mirror.layout else 0,
            "unique_bytes_per_param": session.state.bytes_per_param(),
            "own_digests": own_digests, "held_digests": held_digests,
        }
        if verify:
            own_digests[committed] = live_digest(session.state)
            for src in mirror.sources:
                version, buf = mirror.read_committed(src)
                held_digests.append([src, version, snapshot_digest(mirror.layout, buf)])
    result = {
        "rank": rank, "world_size": world, "zero_stage": engine.zero_optimization_stage(),
        "steps": train["steps"], "losses_hex": [float(x).hex() for x in losses], "losses": losses,
        "fp32_digest": digest(fp32_partitions(engine)),
        "optimizer_digest": digest(t for _, t in optimizer_state_tensors(engine)),
        "fp32_numel": sum(p.numel() for p in fp32_partitions(engine)),
        "num_params": model.num_params(), "tokens_per_step": tokens_per_step,
        "step_s_median": sorted(step_times)[len(step_times) // 2], "total_s": sum(step_times),
        "step_times": step_times, "mirrored_steps": mirrored_steps, "mirror": mirror_result,
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
