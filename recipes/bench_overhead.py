"""Mirroring overhead: the GPT job on 4 ranks with blocks of steps alternating mirroring off
and on (same processes, same data), for each ZeRO stage; then the same with tier 2 a zfec
stripe (``hotspare.retain.k``, ``m``; on k+m logical nodes of one rank each, since a stripe
needs k+m nodes).

    python recipes/bench_overhead.py out=overhead.json
    python recipes/bench_overhead.py out=o.json stages=[2] model=small train.steps=400 block=25
    python recipes/bench_overhead.py out=m.json framework=megatron     # PP=2 x DP=2, key "pp2"

Writes one JSON object: ``stages`` -> {stage (DeepSpeed's ZeRO stage; with
``framework=megatron`` the key ``pp<P>``, and no stripe run): {baseline_step_s, mirror_step_s, overhead,
mirror_bytes_per_step, unique_bytes_per_param, waits, skips, capture_ms_per_round (the training
thread's copy), round_ms_per_round and round_cpu_ms_per_round (the mirror thread's wall and
CPU time), ..., stripe_step_s, stripe_baseline_step_s, stripe_overhead, stripe_*_ms_per_round,
tier2_memory_ratio: {mirror, stripe}}}, where the
memory ratio is the bytes held for tier 2 (own copy or share plus what peers hold) over the
unique state's bytes, measured from what the mirrors hold; prints a table.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from hotspare.testing import job as gpt_job
from hotspare.config import from_mapping


@dataclass
class BenchOverheadConfig(gpt_job.GPTJobConfig):
    """The GPT job plus the benchmark's own settings."""

    out: str = "bench_overhead.json"
    """Where the JSON result goes."""
    stages: list[int] = field(default_factory=lambda: [1, 2, 3])
    """ZeRO stages to measure (one run each)."""
    block: int = 20
    """Steps per block; blocks alternate mirroring off, on, off, ... The first two blocks are warm-up."""
    stripe: bool = True
    """Also measure tier 2 as a stripe (hotspare.retain.k, m)."""


gpt_job.register()
ConfigStore.instance().store(name="bench_overhead_schema", node=BenchOverheadConfig)


def measure(result_ranks: list[dict], block: int) -> dict:
    """Medians over steps (each step's time = the slowest rank's) of off- and on-blocks, warm-up excluded."""
    steps = len(result_ranks[0]["step_times"])
    step_s = [max(r["step_times"][i] for r in result_ranks) for i in range(steps)]
    on_flags = result_ranks[0]["mirrored_steps"]
    keep = range(2 * block, steps)
    base = [step_s[i] for i in keep if not on_flags[i]]
    mirr = [step_s[i] for i in keep if on_flags[i]]
    if not base or not mirr:
        raise ValueError(f"train.steps={steps} leaves no measured off/on blocks after warm-up; use at least "
                         f"{4 * block} steps")
    mirrors = [r["mirror"] for r in result_ranks]
    b, m = statistics.median(base), statistics.median(mirr)
    return {
        "tier2_memory_ratio": sum(x["tier2_bytes"] for x in mirrors) / sum(x["snapshot_bytes"] for x in mirrors),
        "baseline_step_s": b, "mirror_step_s": m, "overhead": m / b - 1.0,
        "mirror_bytes_per_step": sum(x["snapshot_bytes"] * len(x["holders"]) for x in mirrors),
        "unique_bytes_per_param": mirrors[0]["unique_bytes_per_param"],
        "waits": sum(x["waits"] for x in mirrors), "skips": sum(x["skips"] for x in mirrors),
        "rounds": mirrors[0]["rounds"],
        **{f"{key}_ms_per_round": 1e3 * statistics.fmean(x[f"{key}_s"] / max(1, x["rounds"]) for x in mirrors)
           for key in ("capture", "round", "round_cpu")},
        "measured_steps": {"baseline": len(base), "mirror": len(mirr)},
    }


@hydra.main(version_base=None, config_path="../configs", config_name="bench_overhead")
def main(cfg) -> None:
    data = OmegaConf.to_container(cfg, resolve=True)
    bench = from_mapping(BenchOverheadConfig, data)
    run_dir = HydraConfig.get().runtime.output_dir
    results = {}
    retain = bench.hotspare.retain
    # DeepSpeed: one run per ZeRO stage; megatron-core: one run of its pipeline layout.
    runs = ([(str(stage), stage) for stage in bench.stages] if bench.framework == "deepspeed" else
            [(f"pp{bench.parallel.pipeline_stages}", None)])
    for key, stage in runs:
        job_data = {k: v for k, v in data.items() if k not in ("out", "stages", "block", "stripe")}
        if stage is not None:
            job_data["zero"] = {**job_data["zero"], "stage": stage}
        job_data["hotspare"] = {**job_data["hotspare"], "retain": {**job_data["hotspare"].get("retain", {}),
                                                                   "tier2": "mirror"}}
        job = from_mapping(gpt_job.GPTJobConfig, job_data)
        out_dir = os.path.join(run_dir, f"zero{stage}" if stage is not None else key)
        if gpt_job.launch(job, out_dir, mirror_block=bench.block) != 0:
            sys.exit(f"bench_overhead: the {key} run failed; see its output above")
        r = measure(gpt_job.collect(out_dir, job.parallel.num_ranks), bench.block)
        r["tier2_memory_ratio"] = {"mirror": r["tier2_memory_ratio"]}
        # A stripe needs k+m one-rank nodes; a pipeline's stages need ranks of their own, so the
        # stripe is measured on the DeepSpeed path only.
        if bench.stripe and stage is not None:
            n = retain.k + retain.m
            job_data["parallel"] = {**job_data["parallel"], "num_ranks": n, "logical_nodes": n}
            job_data["hotspare"]["retain"] = {**job_data["hotspare"]["retain"], "tier2": "stripe"}
            job = from_mapping(gpt_job.GPTJobConfig, job_data)
            out_dir = os.path.join(run_dir, f"zero{stage}-stripe")
            if gpt_job.launch(job, out_dir, mirror_block=bench.block) != 0:
                sys.exit(f"bench_overhead: the ZeRO-{stage} stripe run failed; see its output above")
            s = measure(gpt_job.collect(out_dir, n), bench.block)
            r.update(stripe_step_s=s["mirror_step_s"], stripe_baseline_step_s=s["baseline_step_s"],
                     stripe_overhead=s["overhead"], stripe_capture_ms_per_round=s["capture_ms_per_round"],
                     stripe_round_ms_per_round=s["round_ms_per_round"],
                     stripe_round_cpu_ms_per_round=s["round_cpu_ms_per_round"], stripe_num_ranks=n, stripe_k=retain.k, stripe_m=retain.m)
            r["tier2_memory_ratio"]["stripe"] = s["tier2_memory_ratio"]
        results[key] = r
    report = {"framework": bench.framework, "stages": results, "num_ranks": bench.parallel.num_ranks, "model": OmegaConf.to_container(cfg.model),
              "steps": bench.train.steps, "block": bench.block, "in_flight": bench.hotspare.mirror.in_flight}
    with open(bench.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"{'stage':>5} {'base ms':>9} {'mirror ms':>9} {'overhead':>9} {'MB/step':>8} {'B/param':>8} "
          f"{'waits':>5} {'skips':>5} {'stripe':>9} {'mem m/s':>11}")
    for stage, r in results.items():
        ratio = r["tier2_memory_ratio"]
        stripe = f"{r['stripe_overhead']:9.3%}" if "stripe_overhead" in r else f"{'-':>9}"
        print(f"{stage:>5} {r['baseline_step_s'] * 1e3:9.2f} {r['mirror_step_s'] * 1e3:9.2f} {r['overhead']:9.3%} "
              f"{r['mirror_bytes_per_step'] / 1e6:8.2f} {r['unique_bytes_per_param']:8.2f} {r['waits']:5d} "
              f"{r['skips']:5d} {stripe} {ratio['mirror']:5.2f}/{ratio.get('stripe', float('nan')):5.2f}")
    print(f"wrote {os.path.abspath(bench.out)}")


if __name__ == "__main__":
    main()
