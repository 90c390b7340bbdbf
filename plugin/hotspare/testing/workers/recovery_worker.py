"""One rank of the GPT job for recipes/bench_recovery.py: the loop written with
``session.resilient`` / ``session.steps``, a fault injected at (rank, step), and the two
restart-based baselines a DeepSpeed user has today.

Options (run.json): ``mode`` 'hotspare' (recover in place) or 'restart' (plain DeepSpeed:
``save_checkpoint`` every ``checkpoint_every`` steps into ``checkpoint_dir``; with ``resume``
``load_checkpoint`` the newest and go on); ``kill_rank`` and ``kill_step`` (SIGKILL before that
step's forward, once); ``faults`` (a list of ``hotspare.testing.faults`` specs, e.g.
``kill@backward:1:5``: what recipes/fault_matrix.py injects). Writes ``rank<R>.json``: monotonic timestamps (process start,
initialised, loaded, the end of every step), the recoveries, and final digests.
"""
from __future__ import annotations

import time

T_PROCESS = time.monotonic()  # before the imports: a restart pays for them too

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import warnings  # noqa: E402

import hotspare  # noqa: E402
from hotspare import faults  # noqa: E402
from hotspare.env import make_deterministic  # noqa: E402
from hotspare.integrations.deepspeed import fp32_partitions, optimizer_state_tensors  # noqa: E402
from hotspare.testing import faults as catalogue  # noqa: E402
from hotspare.testing import digest  # noqa: E402
from hotspare.testing.data import ByteSampler, load_corpus  # noqa: E402
from hotspare.testing import hf, statedigest  # noqa: E402
from hotspare.testing.gpt import GPTConfig  # noqa: E402
from hotspare.worker import role, worker_id  # noqa: E402



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    run = json.load(open(ap.parse_args().config, encoding="utf-8"))
    train, out_dir, mode = run["train"], run["out_dir"], run["mode"]
    make_deterministic(train["seed"])
    import deepspeed.utils

    deepspeed.utils.logger.setLevel("ERROR")
    warnings.filterwarnings("ignore")
    model_cfg = GPTConfig(**run["model"])
    model, loss_of = hf.model_and_loss(model_cfg)
    ds = dict(run["deepspeed"])
    if mode != "hotspare":
        ds.pop("hotspare", None)  # the baseline is DeepSpeed alone
    specs = run.get("faults") or []
    catalogue.arm_recovery_faults(specs, worker_id(), role(), int(os.environ.get("RANK", "-1")))
    session = hotspare.initialize(model=model, config=ds, model_parameters=model.parameters(),
                                  data_state=hotspare.STEP_INDEXED)
    engine = session.engine
    inject = catalogue.Injector(specs, session, worker_id())
    t_init = time.monotonic()
    rank = session.generation.rank
    ckpt_dir, every = run.get("checkpoint_dir", ""), run.get("checkpoint_every", 0)
    t_loaded, loaded_step = t_init, None
    if mode == "restart" and run.get("resume"):
        path, _ = engine.load_checkpoint(ckpt_dir)
        if path is None:
            raise RuntimeError(f"no checkpoint under {ckpt_dir} to resume from")
        loaded_step, t_loaded = engine.global_steps, time.monotonic()
    micro_bs, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    sampler = ByteSampler(load_corpus(run.get("corpus", "")), model_cfg.seq_len, micro_bs, seed=train["seed"])
    step_end, losses, save_s = {}, {}, []
    first = role() == "active" and not run.get("resume")

    def body(step: int):
        if first and rank == run.get("kill_rank") and step == run.get("kill_step") and worker_id() == f"a{rank}":
            with open(os.path.join(out_dir, "fault.json"), "w", encoding="utf-8") as f:
                json.dump({"t": time.monotonic(), "rank": rank, "step": step}, f)
            if run.get("lose_node"):
                faults.lose_node()  # the rank's whole logical node: its keeper and spares too
            os.kill(os.getpid(), signal.SIGKILL)
        for micro in range(accum):
            tokens, targets = sampler.batch(step * accum + micro, rank)
            inject.forward(step, micro)
            inject.backward(step, micro, hf.first_block(engine.module))
            loss = loss_of(engine, tokens, targets)
            engine.backward(loss)
            if micro == accum - 1:
                inject.before_step(step)
            engine.step()
        inject.after_step(step)
        losses[step] = float(loss).hex()
        if mode == "restart" and every and engine.global_steps % every == 0:
            t0 = time.monotonic()
            engine.save_checkpoint(ckpt_dir, tag=f"step{engine.global_steps}")
            save_s.append(time.monotonic() - t0)
        step_end[step] = time.monotonic()

    if mode == "hotspare":
        train_step = session.resilient(body)
        for step in session.steps(train["steps"]):
            train_step(step)
    else:
        for step in range(engine.global_steps, train["steps"]):
            body(step)
    result = {"rank": rank, "worker": worker_id(), "mode": mode, "t_process": T_PROCESS, "t_init": t_init,
              "t_loaded": t_loaded, "loaded_step": loaded_step, "step_end": step_end, "losses": losses,
              "save_s": save_s, "recoveries": session.recoveries, "global_steps": engine.global_steps,
              "fp32_digest": digest(fp32_partitions(engine)),
              "optimizer_digest": digest(t for _, t in optimizer_state_tensors(engine)),
              "state_digest": statedigest.deepspeed_engine(engine)}
    session.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
