"""One rank of the GPT job on megatron-core (``framework=megatron``): pipeline stages x data
parallelism, the 1F1B schedule, the distributed optimizer, started through
``hotspare.integrations.megatron.initialize`` under hotspare-run.

The counterpart of gpt_worker.py (train_gpt.py) and recovery_worker.py (bench_recovery.py) for
the Megatron path: the same run.json, the same ``rank<R>.json`` keys. Options (run.json):
``mode`` 'train' (the default: progress lines, the recipe's summary), 'hotspare' (the
benchmark's in-place run), 'restart' (megatron-core alone: ``dist_checkpointing.save`` every
``checkpoint_every`` iterations into ``checkpoint_dir``; with ``resume`` load the newest and
go on); ``fault`` {rank, step} or ``kill_rank``/``kill_step`` (SIGKILL before that
iteration's forward, once).
"""
from __future__ import annotations

import time

T_PROCESS = time.monotonic()  # before the imports: a restart pays for them too

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hotspare import faults  # noqa: E402
from hotspare.env import make_deterministic  # noqa: E402
import hotspare  # noqa: E402
from hotspare.integrations import megatron  # noqa: E402
from hotspare.testing import faults as catalogue  # noqa: E402
from hotspare.testing import mcore_gpt, statedigest  # noqa: E402
from hotspare.testing import digest  # noqa: E402
from hotspare.testing.data import ByteSampler, load_corpus  # noqa: E402
from hotspare.testing.gpt import GPTConfig  # noqa: E402
from hotspare.worker import role, worker_id  # noqa: E402



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    run = json.load(open(ap.parse_args().config, encoding="utf-8"))
    train, out_dir, mode = run["train"], run["out_dir"], run.get("mode", "train")
    make_deterministic(train["seed"])
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        from hotspare_patches import megatron_core_cpu

        megatron_core_cpu.apply()
    model_cfg = GPTConfig(**run["model"])
    t = mcore_gpt.MegatronTrain(micro_batch=train["micro_batch"], microbatches=train["grad_accum"], lr=train["lr"],
                                warmup_steps=train["warmup_steps"], decay_steps=train["steps"],
                                weight_decay=train["weight_decay"], grad_clip=train["grad_clip"], seed=train["seed"])
    hs = run["deepspeed"].get("hotspare") if mode != "restart" else None
    specs = run.get("faults") or []
    catalogue.arm_recovery_faults(specs, worker_id(), role(), int(os.environ.get("RANK", "-1")))
    vp = run.get("virtual_stages", 1)
    session = megatron.initialize(lambda: mcore_gpt.build(model_cfg, t), hs,
                                  pipeline_model_parallel_size=run["pipeline_stages"],
                                  tensor_model_parallel_size=run.get("tensor_parallel", 1),
                                  virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                                  data_state=hotspare.STEP_INDEXED)
    from megatron.core import parallel_state as ps

    t_init = time.monotonic()
    rank, world = session.generation.rank, session.generation.world_size
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    last_stage = ps.is_pipeline_last_stage()
    model, optimizer, sched = session.model, session.optimizer, session.scheduler
    inject = catalogue.Injector(specs, session, worker_id())
    ckpt_dir, every = run.get("checkpoint_dir", ""), run.get("checkpoint_every", 0)
    t_loaded, loaded_step = t_init, None
    if mode == "restart" and run.get("resume"):
        loaded_step = load_checkpoint(session, ckpt_dir)
        t_loaded = time.monotonic()
    sampler = ByteSampler(load_corpus(run.get("corpus", "")), model_cfg.seq_len, t.micro_batch, seed=train["seed"])
    tokens_per_step = dp_size * t.micro_batch * t.microbatches * model_cfg.seq_len
    # No collective between initialize and the loop: a spare returns from initialize into a job
    # whose other ranks are inside the loop already.
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    # A tensor-parallel rank holds a slice of the split parameters and a copy of the others.
    stage_params = sum(p.numel() for chunk in model for p in chunk.parameters()
                       if tp_rank == 0 or getattr(p, "tensor_model_parallel", False))
    if rank == 0 and not session.spare and mode == "train":
        print(f"GPT (megatron-core) {stage_params:,} params on rank 0 | {run['pipeline_stages']} pipeline stages"
              f"{f' ({vp} virtual each)' if vp > 1 else ''} x {tp_size} tensor x {dp_size} data-parallel | "
              f"{'interleaved ' if vp > 1 else ''}1F1B, {t.microbatches} microbatches | {tokens_per_step} "
              f"tokens/iteration", flush=True)
    fault = run.get("fault") or {}
    kill_rank, kill_step = fault.get("rank", run.get("kill_rank")), fault.get("step", run.get("kill_step"))
    first = role() == "active" and not run.get("resume")
    losses, step_times, step_end, save_s = {}, {}, {}, []
    window = {"t0": time.perf_counter(), "steps": 0}

    def batches(step: int):
        for mb in range(t.microbatches):
            yield sampler.batch(step * t.microbatches + mb, dp_rank)

    block = run.get("mirror_block", 0)
    mirrored = {}

    def body(step: int) -> None:
        mirror = session.mirror  # a recovery starts a new one
        if mirror is not None and block:
            # Alternate blocks of iterations with mirroring off and on (bench_overhead.py).
            mirror.enabled = (step // block) % 2 == 1
        mirrored[step] = mirror is not None and mirror.enabled
        if first and rank == kill_rank and step == kill_step and worker_id() == f"a{rank}":
            with open(os.path.join(out_dir, "fault.json"), "w", encoding="utf-8") as f:
                json.dump({"t": time.monotonic(), "rank": rank, "step": step}, f)
            if run.get("lose_node"):
                faults.lose_node()
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        microbatch = [0]

        def forward(data, chunk):
            inject.forward(step, microbatch[0])
            inject.backward(step, microbatch[0], chunk.module.decoder.layers[0])
            microbatch[0] += 1
            return mcore_gpt.forward_step(data, chunk)

        loss = mcore_gpt.train_iteration(model, optimizer, sched, batches(step), t, model_cfg.seq_len,
                                         forward=forward, before_step=lambda: inject.before_step(step))
        step_times[step] = time.perf_counter() - t0
        if loss is not None:
            losses[step] = loss
        if session.events is not None:
            session.events("step", version=step, seconds=step_times[step], worker=worker_id())
        if mode == "restart":
            session.state.iteration = step + 1  # (in place, steps() counts)
        if mode == "restart" and every and (step + 1) % every == 0:
            t1 = time.monotonic()
            save_checkpoint(session, ckpt_dir, step + 1)
            save_s.append(time.monotonic() - t1)
        window["steps"] += 1
        if mode == "train" and ((step + 1) % train["log_interval"] == 0 or step + 1 == train["steps"]):
            first_in = step - step % train["log_interval"]
            mine = [losses[s] for s in range(first_in, step + 1) if s in losses]
            window_loss = torch.tensor([sum(mine), len(mine)], dtype=torch.float64)
            dist.all_reduce(window_loss)  # inside the iteration: a peer lost here is recovered too
            elapsed = time.perf_counter() - window["t0"]
            if rank == 0:
                print(f"step {step + 1:5d} | loss {window_loss[0].item() / max(1.0, window_loss[1].item()):.4f} | "
                      f"{tokens_per_step * window['steps'] / elapsed:,.0f} tokens/s", flush=True)
            window.update(t0=time.perf_counter(), steps=0)
        step_end[step] = time.monotonic()

    if mode == "restart":
        for step in range(session.state.iteration, train["steps"]):
            body(step)
    else:
        train_step = session.resilient(body)
        for step in session.steps(train["steps"]):
            if step > 0:
                # The previous iteration's mirror round started when steps() counted it.
                done = len(session.recoveries)
                session.resilient(inject.after_step)(step - 1)
                if len(session.recoveries) != done:
                    continue  # recovered: steps() yields the landing iteration next
            train_step(step)
    mirror_result = None
    if session.mirror is not None:
        session.mirror.enabled = True
        committed = session.mirror.flush()
        mirror_result = {**session.mirror.summary(), "global_committed": committed,
                         "unique_bytes_per_param": session.state.bytes_per_param()}
    steps = range(train["steps"])
    shards, moments = mcore_gpt.shard_tensors(optimizer), mcore_gpt.moment_tensors(optimizer)
    result = {
        "rank": rank, "worker": worker_id(), "spare": session.spare, "world_size": world, "mode": mode,
        "framework": "megatron", "zero_stage": None, "pipeline_stage": ps.get_pipeline_model_parallel_rank(),
        "data_parallel_rank": dp_rank, "tensor_parallel_rank": tp_rank, "chunks": len(model),
        "steps": train["steps"], "last_stage": last_stage,
        "losses_hex": {str(s): float(losses[s]).hex() for s in steps if s in losses},
        "losses": [losses[s] for s in steps if s in losses], "first_step": min(losses, default=0),
        "fp32_digest": digest(shards), "optimizer_digest": digest(moments),
        "state_digest": statedigest.megatron(model, optimizer, sched),
        "num_params": stage_params, "tokens_per_step": tokens_per_step,
        "step_s_median": statistics.median(step_times.values()) if step_times else 0.0,
        "step_times": [step_times[s] for s in steps if s in step_times],
        "mirrored_steps": [mirrored[s] for s in steps if s in mirrored], "mirror": mirror_result,
        "step_end": {str(s): v for s, v in step_end.items()}, "t_process": T_PROCESS, "t_init": t_init,
        "t_loaded": t_loaded, "loaded_step": loaded_step, "save_s": save_s, "global_steps": session.state.iteration,
        "recoveries": session.recoveries,
    }
    session.close()
    result["threads_after_close"] = sorted(th.name for th in threading.enumerate() if th.name.startswith("hotspare"))
    tmp = os.path.join(out_dir, f".rank{rank}.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    return 0


# megatron-core 0.16's default for the distributed optimizer ('fully_sharded_model_space') is
# deprecated and refused by its own ShardedTensor check (flattened_range); 'dp_reshardable'
# saves each rank's buffers in parallel, with no gather: the fastest save and load it offers.
def save_checkpoint(session, directory: str, iteration: int) -> None:
    """megatron-core's own persistent checkpoint (dist_checkpointing) of ``iteration``, plus the
    iteration, scheduler and this rank's RNG states (what a bitwise resume needs besides the tensors)."""
    from megatron.core import dist_checkpointing

    path = os.path.join(directory, f"iter{iteration:07d}")
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(session.state.sharded_state_dict(), path)
    torch.save(session.state.extras(), os.path.join(path, megatron.extras_file(session.generation.rank)))
    dist.barrier()


def load_checkpoint(session, directory: str) -> int:
    """Load the newest checkpoint under ``directory`` into the live objects (hotspare's loader,
    which also mends megatron-core's Adam step counts: see MegatronState.load_checkpoint);
    returns its iteration."""
    paths = sorted(glob.glob(os.path.join(directory, "iter*")))
    if not paths:
        raise RuntimeError(f"no checkpoint under {directory} to resume from")
    session.state.load_checkpoint(directory, os.path.basename(paths[-1]))
    return session.state.iteration


if __name__ == "__main__":
    sys.exit(main())
