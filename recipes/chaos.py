"""Chaos soak: during one long run, SIGKILL random active ranks at random times (seeded; a bounded
number of kills within a bounded window, at least ``min_gap_s`` apart so the spare pool refills),
from outside the job and with no regard for where in the step they land; then check that the
run ended bitwise identical (fp32 state, optimizer state, losses) to an uninterrupted run.

    python recipes/chaos.py out=chaos.json                                  # ZeRO-2, 3 kills
    python recipes/chaos.py out=c.json seed=7 kills=5 train.steps=600 variant=megatron

The rank to kill is drawn from the coordinator's newest plan (so a spare that took a rank can be
killed in turn), its process found by its worker id. JSON: ``kills`` (time after the start,
rank, worker id, generation), ``outcome`` (as in recipes/fault_matrix.py), ``bitwise_identical``,
``recoveries``, ``lost_iterations`` (the most any recovery lost), ``recovery_s`` (each recovery's
longest rank), ``seconds``. Exits 1 unless the run finished bitwise identical with every kill
recovered.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from fault_matrix import job_of, run_job
from hotspare.config import from_mapping
from hotspare.testing import job as gpt_job
from hotspare.testing.harness import Job, ranks_of, training_started
from hotspare.testing.matrix import ChaosConfig, classify, schedule

gpt_job.register()
ConfigStore.instance().store(name="chaos_schema", node=ChaosConfig)


def soak(cfg: ChaosConfig, job, out_dir: str) -> tuple[int | None, list[dict], str]:
    """Run the job and kill on schedule; (exit code or None if hung, kills, launcher log tail)."""
    spec = gpt_job.launch_spec(job, out_dir, spares_per_node=cfg.spares, mode="hotspare")
    handle = Job(spec, out_dir, name="chaos")
    kills: list[dict] = []
    events = os.path.join(out_dir, "events")
    while handle.running() and not training_started(events):
        time.sleep(0.2)
    t0 = time.monotonic()
    rng = random.Random(cfg.seed + 1)
    for at in schedule(cfg):
        while handle.running() and time.monotonic() - t0 < at:
            time.sleep(0.05)
        if not handle.running():
            break
        # The soak reads the job's plans as an operator would: with the job's secret.
        plan = handle.plan(job.parallel.num_ranks)
        rank = rng.randrange(job.parallel.num_ranks)
        wid = plan.workers[str(rank)]
        killed = handle.kill(wid)
        kills.append({"t": time.monotonic() - t0, "rank": rank, "worker": wid, "generation": plan.generation,
                      "killed": killed})
        print(f"chaos: t={kills[-1]['t']:.1f} s killed rank {rank} ({wid}, generation {plan.generation})", flush=True)
    code = handle.wait(cfg.timeout_s - (time.monotonic() - handle.started))
    return code, kills, handle.tail()


@hydra.main(version_base=None, config_path="../configs", config_name="chaos")
def main(cfg) -> None:
    t_start = time.monotonic()
    data = OmegaConf.to_container(cfg, resolve=True)
    chaos = from_mapping(ChaosConfig, data)
    run_dir = HydraConfig.get().runtime.output_dir
    job = job_of(data, chaos.variant)
    world = job.parallel.num_ranks
    ref_dir = os.path.join(run_dir, "uninterrupted")
    code, tail = run_job(job, ref_dir, 0, chaos.timeout_s)
    ref = ranks_of(ref_dir)
    if code != 0 or sorted(ref) != list(range(world)):
        sys.exit(f"chaos: the uninterrupted run failed (exit {code}):\n{tail}")
    out_dir = os.path.join(run_dir, "chaos")
    code, kills, tail = soak(chaos, job, out_dir)
    ranks = ranks_of(out_dir)
    row = classify(code, tail, ranks, ref, world)
    recoveries = sorted({(rec["generation"], rec["version"]) for r in ranks.values() for rec in r.get("recoveries", [])})
    result = {"variant": chaos.variant, "seed": chaos.seed, "steps": chaos.train.steps, "kills": kills,
              "outcome": row["outcome"], "bitwise_identical": row["bitwise_identical"],
              "lost_iterations": row["lost_iterations"], "recovery_s": row["recovery_s"],
              "recoveries": [{"generation": g, "version": v} for g, v in recoveries], "note": row["note"],
              "exit_code": code, "seconds": time.monotonic() - t_start}
    with open(chaos.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("outcome", "bitwise_identical", "lost_iterations", "recovery_s")}))
    print(f"{len(kills)} kills, {len(recoveries)} recoveries; wrote {os.path.abspath(chaos.out)}")
    if not (row["outcome"] == "recovered" and row["bitwise_identical"] and all(k["killed"] for k in kills)):
        sys.exit(1)


if __name__ == "__main__":
    main()
