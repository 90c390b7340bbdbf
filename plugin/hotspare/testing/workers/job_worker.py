"""One rank of the GPT job (hotspare.testing.job), on DeepSpeed or megatron-core: the one worker
train_gpt.py, the benchmarks, the fault matrix, chaos and the tests start through hotspare-run
with ``--config RUN.json``.

run.json (written by ``job.launch_spec``) says ``framework`` ('deepspeed' or 'megatron') and
``mode``:

- 'train' (the default): recover in place, print progress, record what the recipe's summary needs;
- 'hotspare': the same loop without the progress lines (the benchmarks' in-place run);
- 'restart': the host alone, no hotspare: its own checkpoint every ``checkpoint_every`` steps into
  ``checkpoint_dir``; with ``resume``, load the newest and go on (the benchmarks' baselines).

Faults: ``fault`` {rank, step} or ``kill_rank``/``kill_step`` SIGKILL that rank before that step's
forward, once (``lose_node``: its whole logical node), and record when in fault.json; ``faults``
lists :mod:`hotspare.testing.faults` specs (``kill@backward:1:5``...). Other options:
``verify_mirror`` (digests of every live and mirrored version), ``mirror_block`` (alternate blocks
of steps with mirroring off and on).

Writes ``rank<R>.json``; the same keys on both hosts: ``losses`` maps each step (a string) to its
loss as float hex (a step run again after a recovery overwrites its first run; a megatron rank off
the last pipeline stage has none), ``first_step``, ``step_times``/``step_end``/``mirrored_steps``,
the monotonic ``t_process``/``t_init``/``t_loaded``, ``recoveries``, and digests: ``state_digest``
from the host's own view, ``fp32_digest``/``optimizer_digest`` of the master weights and moments.
"""
from __future__ import annotations

import time

T_PROCESS = time.monotonic()  # before the imports: a restart pays for them too

import argparse  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hotspare  # noqa: E402
from hotspare import faults  # noqa: E402
from hotspare.env import make_deterministic  # noqa: E402
from hotspare.snapshot import read_meta  # noqa: E402
from hotspare.testing import digest, statedigest  # noqa: E402
from hotspare.testing import faults as catalogue  # noqa: E402
from hotspare.testing.data import ByteSampler, load_corpus  # noqa: E402
from hotspare.testing.gpt import GPTConfig  # noqa: E402
from hotspare.worker import role, worker_id  # noqa: E402

MODES = ("train", "hotspare", "restart")


class DeepSpeedRank:
    """An ordinary DeepSpeed loop started through ``hotspare.initialize``."""

    # The engine's optimizer step starts the mirror round: a fault after the step is in it.
    round_in_step = True

    def __init__(self, run: dict, model_cfg: GPTConfig, specs: list):
        import deepspeed.utils

        from hotspare.testing import hf

        # DeepSpeed's start-up chatter is not the user's concern in this recipe.
        deepspeed.utils.logger.setLevel("ERROR")
        self.hf = hf
        model, self.loss_of = hf.model_and_loss(model_cfg)
        self.num_params = sum(p.numel() for p in model.parameters())
        ds = dict(run["deepspeed"])
        if run["mode"] == "restart":
            ds.pop("hotspare", None)  # the baseline is DeepSpeed alone
        self.session = hotspare.initialize(model=model, config=ds, model_parameters=model.parameters(),
                                           collective_timeout_s=run.get("collective_timeout_s", 120.0),
                                           data_state=hotspare.STEP_INDEXED)  # a batch is a function of the step
        self.engine = e = self.session.engine
        self.micro_batch, self.accum = e.train_micro_batch_size_per_gpu(), e.gradient_accumulation_steps()
        self.data_rank, data_size = self.session.generation.rank, self.session.generation.world_size
        self.tokens_per_step = data_size * self.micro_batch * self.accum * model_cfg.seq_len
        self.banner = (f"{model_cfg.family} {self.num_params:,} params | ZeRO-{e.zero_optimization_stage()} | "
                       f"{data_size} ranks | {self.tokens_per_step} tokens/step")

    def load(self, directory: str) -> int:
        path, _ = self.engine.load_checkpoint(directory)
        if path is None:
            raise RuntimeError(f"no checkpoint under {directory} to resume from")
        return self.engine.global_steps

    def first_step(self) -> int:
        return self.engine.global_steps

    def step(self, step: int, sampler: ByteSampler, inject) -> float:
        e = self.engine
        for micro in range(self.accum):
            tokens, targets = sampler.batch(step * self.accum + micro, self.data_rank)
            inject.forward(step, micro, e.module)
            inject.backward(step, micro, self.hf.first_block(e.module))
            loss = self.loss_of(e, tokens, targets)
            e.backward(loss)
            if micro == self.accum - 1:
                inject.before_step(step)
            e.step()
        return loss.item()

    def save(self, directory: str, step: int) -> None:
        self.engine.save_checkpoint(directory, tag=f"step{step + 1}")

    def result(self) -> dict:
        from hotspare.integrations.deepspeed import fp32_partitions, optimizer_state_tensors

        e = self.engine
        return {"framework": "deepspeed", "zero_stage": e.zero_optimization_stage(), "global_steps": e.global_steps,
                "fp32_digest": digest(fp32_partitions(e)),
                "optimizer_digest": digest(t for _, t in optimizer_state_tensors(e)),
                "state_digest": statedigest.deepspeed_engine(e),
                "fp32_numel": sum(p.numel() for p in fp32_partitions(e))}


class MegatronRank:
    """megatron-core's loop shape: pipeline stages x tensor x data parallelism, the 1F1B schedule
    (interleaved with virtual stages), the distributed optimizer, through
    ``hotspare.integrations.megatron.initialize``."""

    # The mirror round starts when steps() counts the iteration, after the loop body.
    round_in_step = False

    def __init__(self, run: dict, model_cfg: GPTConfig, specs: list):
        from hotspare.integrations import megatron
        from hotspare.testing import mcore_gpt

        if not torch.cuda.is_available():
            from hotspare_patches import megatron_core_cpu

            megatron_core_cpu.apply()
        train = run["train"]
        self.mcore_gpt, self.seq_len = mcore_gpt, model_cfg.seq_len
        self.t = t = mcore_gpt.MegatronTrain(
            micro_batch=train["micro_batch"], microbatches=train["grad_accum"], lr=train["lr"],
            warmup_steps=train["warmup_steps"], decay_steps=train["steps"], weight_decay=train["weight_decay"],
            grad_clip=train["grad_clip"], seed=train["seed"])
        vp = run.get("virtual_stages", 1)
        hs = run["deepspeed"].get("hotspare") if run["mode"] != "restart" else None
        self.session = megatron.initialize(lambda: mcore_gpt.build(model_cfg, t), hs,
                                           pipeline_model_parallel_size=run["pipeline_stages"],
                                           tensor_model_parallel_size=run.get("tensor_parallel", 1),
                                           virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                                           data_state=hotspare.STEP_INDEXED)
        from megatron.core import parallel_state as ps

        self.ps, self.extras_file = ps, megatron.extras_file
        self.data_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.micro_batch = t.micro_batch
        self.tokens_per_step = dp_size * t.micro_batch * t.microbatches * model_cfg.seq_len
        tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        # A tensor-parallel rank holds a slice of the split parameters and a copy of the others.
        self.num_params = sum(p.numel() for chunk in self.session.model for p in chunk.parameters()
                              if tp_rank == 0 or getattr(p, "tensor_model_parallel", False))
        self.banner = (f"GPT (megatron-core) {self.num_params:,} params on rank 0 | {run['pipeline_stages']} pipeline "
                       f"stages{f' ({vp} virtual each)' if vp > 1 else ''} x {tp_size} tensor x {dp_size} "
                       f"data-parallel | {'interleaved ' if vp > 1 else ''}1F1B, {t.microbatches} microbatches | "
                       f"{self.tokens_per_step} tokens/iteration")
        self.restart = run["mode"] == "restart"

    # megatron-core 0.16's default for the distributed optimizer ('fully_sharded_model_space') is
    # deprecated and refused by its own ShardedTensor check (flattened_range); 'dp_reshardable'
    # saves each rank's buffers in parallel, with no gather: the fastest save and load it offers.
    def load(self, directory: str) -> int:
        """Load the newest checkpoint under ``directory`` (hotspare's loader, which also mends
        megatron-core's Adam step counts: see MegatronState.load_checkpoint)."""
        paths = sorted(glob.glob(os.path.join(directory, "iter*")))
        if not paths:
            raise RuntimeError(f"no checkpoint under {directory} to resume from")
        self.session.state.load_checkpoint(directory, os.path.basename(paths[-1]))
        return self.session.state.iteration

    def first_step(self) -> int:
        return self.session.state.iteration

    def step(self, step: int, sampler: ByteSampler, inject) -> float | None:
        s, t = self.session, self.t
        microbatch = [0]

        def forward(data, chunk):
            inject.forward(step, microbatch[0], chunk)
            inject.backward(step, microbatch[0], chunk.module.decoder.layers[0])
            microbatch[0] += 1
            return self.mcore_gpt.forward_step(data, chunk)

        batches = (sampler.batch(step * t.microbatches + mb, self.data_rank) for mb in range(t.microbatches))
        loss = self.mcore_gpt.train_iteration(s.model, s.optimizer, s.scheduler, batches, t, self.seq_len,
                                              forward=forward, before_step=lambda: inject.before_step(step))
        if self.restart:
            s.state.iteration = step + 1  # hotspare's steps() counts it otherwise
        return loss

    def save(self, directory: str, step: int) -> None:
        """megatron-core's own persistent checkpoint (dist_checkpointing), plus the iteration,
        scheduler and this rank's RNG states (what a bitwise resume needs besides the tensors)."""
        from megatron.core import dist_checkpointing

        s = self.session
        path = os.path.join(directory, f"iter{step + 1:07d}")
        os.makedirs(path, exist_ok=True)
        dist_checkpointing.save(s.state.sharded_state_dict(), path)
        torch.save(s.state.extras(), os.path.join(path, self.extras_file(s.generation.rank)))
        dist.barrier()

    def result(self) -> dict:
        s, ps, mg = self.session, self.ps, self.mcore_gpt
        return {"framework": "megatron", "zero_stage": None, "global_steps": s.state.iteration,
                "pipeline_stage": ps.get_pipeline_model_parallel_rank(), "data_parallel_rank": self.data_rank,
                "tensor_parallel_rank": ps.get_tensor_model_parallel_rank(), "chunks": len(s.model),
                "last_stage": ps.is_pipeline_last_stage(),
                "fp32_digest": digest(mg.shard_tensors(s.optimizer)),
                "optimizer_digest": digest(mg.moment_tensors(s.optimizer)),
                "state_digest": statedigest.megatron(s.model, s.optimizer, s.scheduler)}


HOSTS = {"deepspeed": DeepSpeedRank, "megatron": MegatronRank}


def snapshot_digest(layout, buf) -> str:
    """Digest of a mirrored snapshot: its tensor segments and its metadata."""
    h = hashlib.sha256(digest(layout.views(buf)).encode())
    h.update(json.dumps(read_meta(buf, layout), sort_keys=True).encode())
    return h.hexdigest()


def live_digest(state) -> str:
    """The same digest computed from the live host state (not from any copy of it)."""
    h = hashlib.sha256(digest(t for _, t in state.tensors()).encode())
    h.update(json.dumps(json.loads(json.dumps(state.meta())), sort_keys=True).encode())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    run = json.load(open(ap.parse_args().config, encoding="utf-8"))
    run.setdefault("mode", "train")
    train, out_dir, mode = run["train"], run["out_dir"], run["mode"]
    framework = run.get("framework", "deepspeed")
    if mode not in MODES or framework not in HOSTS:
        raise ValueError(f"run.json: mode={mode!r} must be one of {MODES}, framework={framework!r} one of "
                         f"{tuple(HOSTS)}")
    make_deterministic(train["seed"])
    warnings.filterwarnings("ignore")
    specs = run.get("faults") or []
    catalogue.arm_recovery_faults(specs, worker_id(), role(), int(os.environ.get("RANK", "-1")))
    model_cfg = GPTConfig(**run["model"])
    host = HOSTS[framework](run, model_cfg, specs)
    session = host.session
    t_init = time.monotonic()
    rank, world = session.generation.rank, session.generation.world_size
    inject = catalogue.Injector(specs, session, worker_id())
    ckpt_dir, every = run.get("checkpoint_dir", ""), run.get("checkpoint_every", 0)
    t_loaded, loaded_step = t_init, None
    if mode == "restart" and run.get("resume"):
        loaded_step, t_loaded = host.load(ckpt_dir), time.monotonic()
    sampler = ByteSampler(load_corpus(run.get("corpus", "")), model_cfg.seq_len, host.micro_batch, seed=train["seed"])
    # No collective between initialize and the loop: a spare returns from initialize into a job
    # whose other ranks are inside the loop already.
    if rank == 0 and not session.spare and mode == "train":
        print(host.banner, flush=True)
    fault = run.get("fault") or {}
    kill_rank, kill_step = fault.get("rank", run.get("kill_rank")), fault.get("step", run.get("kill_step"))
    first = role() == "active" and not run.get("resume")
    verify, block = run.get("verify_mirror", False), run.get("mirror_block", 0)
    own_digests, held_digests = {}, []
    # By step: a step run again after a recovery overwrites what its first run left.
    losses, step_times, step_end, mirrored, save_s = {}, {}, {}, {}, []
    window = {"t0": time.perf_counter(), "steps": 0}

    def body(step: int) -> None:
        mirror = session.mirror  # a recovery starts a new one
        if mirror is not None and block:
            # Alternate blocks of steps with mirroring off and on (same process, same data).
            mirror.enabled = (step // block) % 2 == 1
        mirrored[step] = mirror is not None and mirror.enabled
        if first and rank == kill_rank and step == kill_step and worker_id() == f"a{rank}":
            with open(os.path.join(out_dir, "fault.json"), "w", encoding="utf-8") as f:
                json.dump({"t": time.monotonic(), "rank": rank, "step": step}, f)
            if run.get("lose_node"):
                faults.lose_node()  # the rank's whole logical node: its keeper and spares too
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        loss = host.step(step, sampler, inject)
        step_times[step] = time.perf_counter() - t0
        if session.events is not None:  # for the recipe's timeline plot
            session.events("step", version=step, seconds=step_times[step], worker=worker_id())
        if loss is not None:
            losses[step] = loss
        if host.round_in_step:
            inject.after_step(step)
        if mode == "restart" and every and (step + 1) % every == 0:
            t1 = time.monotonic()
            host.save(ckpt_dir, step)
            save_s.append(time.monotonic() - t1)
        if verify and mirror is not None:
            own_digests[step + 1] = live_digest(session.state)
            for src in mirror.sources:
                version, buf = mirror.read_committed(src)
                # Version 0 (before the first step) has no optimizer state: another layout.
                if buf is not None and buf.numel() == mirror.layout.nbytes:
                    held_digests.append([src, version, snapshot_digest(mirror.layout, buf)])
        window["steps"] += 1
        if mode == "train" and ((step + 1) % train["log_interval"] == 0 or step + 1 == train["steps"]):
            progress(step)
        step_end[step] = time.monotonic()

    def progress(step: int) -> None:
        # The window's mean loss from the per-step record: exact after a step ran twice. A spare
        # has only the steps from where it landed, a megatron rank off the last stage none: sum
        # and count travel together.
        first_in = step - step % train["log_interval"]
        mine = [losses[s] for s in range(first_in, step + 1) if s in losses]
        window_loss = torch.tensor([sum(mine), len(mine)], dtype=torch.float64)
        dist.all_reduce(window_loss)  # inside the step: a peer lost here is recovered too
        elapsed = time.perf_counter() - window["t0"]
        if rank == 0:
            print(f"step {step + 1:5d} | loss {window_loss[0].item() / max(1.0, window_loss[1].item()):.4f} | "
                  f"{host.tokens_per_step * window['steps'] / elapsed:,.0f} tokens/s", flush=True)
        window.update(t0=time.perf_counter(), steps=0)

    if mode == "restart":
        for step in range(host.first_step(), train["steps"]):
            body(step)
    elif train.get("loop") == "own":  # no steps(): engine.step mirrors, reports and hands over
        train_step = session.resilient(body)
        while session.step_count() < train["steps"]:
            train_step(session.step_count())
    else:
        train_step = session.resilient(body)
        for step in session.steps(train["steps"]):
            if step > 0 and not host.round_in_step:
                # The previous iteration's mirror round started when steps() counted it.
                done = len(session.recoveries)
                session.resilient(inject.after_step)(step - 1)
                if len(session.recoveries) != done:
                    continue  # recovered: steps() yields the landing iteration next
            train_step(step)

    mirror_result = None
    if session.mirror is not None:
        mirror = session.mirror
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
        "rank": rank, "worker": worker_id(), "spare": session.spare, "world_size": world, "mode": mode,
        "steps": train["steps"], "losses": {str(s): float(losses[s]).hex() for s in steps if s in losses},
        "first_step": min(losses, default=0), "num_params": host.num_params, "tokens_per_step": host.tokens_per_step,
        "step_s_median": statistics.median(step_times.values()) if step_times else 0.0,
        "total_s": sum(step_times.values()), "step_times": [step_times[s] for s in steps if s in step_times],
        "step_end": {str(s): t for s, t in step_end.items()},
        "mirrored_steps": [mirrored[s] for s in steps if s in mirrored], "mirror": mirror_result,
        "t_process": T_PROCESS, "t_init": t_init, "t_loaded": t_loaded, "loaded_step": loaded_step, "save_s": save_s,
        "recoveries": session.recoveries, **host.result(),
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
