"""A slow rank handed to a spare: throughput before the slowdown, while slow, and after the
handover; the handover's pause; how many steps the detection took; lost iterations; bitwise.

One rank's forward becomes ``factor`` times slower from ``slow_step`` on (the fault
``slow@forward:RANK:STEP:FACTOR``: it sleeps ``factor - 1`` times what its forward computed).
With ``hotspare.stragglers`` on, the coordinator finds it by its compute time and the rank is
handed to a spare at a step boundary (docs/stragglers.md). An uninterrupted run of the same job
is the bitwise reference.

    python recipes/bench_straggler.py out=straggler.json
    python recipes/bench_straggler.py out=s.json factor=5 hotspare.stragglers.window=5

JSON: ``steps_per_s_before``, ``steps_per_s_slow``, ``steps_per_s_after`` (rank 0's completed
steps per second: before the slowdown, from it to the handover, from two steps after the handover
to the end), ``handover_pause_s`` (the longest gap between two of rank 0's completed steps around
the handover) against ``median_step_s`` (before the slowdown), ``detect_steps`` (steps from the
slowdown to the step the job landed on), ``lost_iterations``, ``handover_step``,
``bitwise_identical``. All times from one clock (CLOCK_MONOTONIC, shared by the processes).

``steps_per_s_after`` includes the start of the successor spare (the launcher starts one once
the new generation caught up: imports and a model build, on the same cores here). The second
half of the steps after the handover is measured on its own too (``steps_per_s_late``), next to
the same steps of the uninterrupted run (``ref_steps_per_s_late``, ``late_vs_uninterrupted``):
a longer ``train.steps`` puts the successor's start before it.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from hotspare.config import ConfigError, from_mapping
from hotspare.testing import job as gpt_job
from hotspare.testing import statedigest


@dataclass
class BenchStragglerConfig(gpt_job.GPTJobConfig):
    """The GPT job plus the slow rank."""

    out: str = "bench_straggler.json"
    """Where the JSON result goes."""
    slow_rank: int = 1
    """The rank that becomes slow."""
    slow_step: int = 20
    """The step (0-based) from which its forward is ``factor`` times slower."""
    factor: int = 3
    """How many times slower its forward becomes (at least 2)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.slow_rank < self.parallel.num_ranks:
            raise ConfigError(f"slow_rank={self.slow_rank} must be a rank below parallel.num_ranks="
                              f"{self.parallel.num_ranks}")
        if not 2 < self.slow_step < self.train.steps - 10:
            raise ConfigError(f"slow_step={self.slow_step} must leave 3 steps before it and 10 after it (train.steps="
                              f"{self.train.steps})")
        if self.factor < 2:
            raise ConfigError(f"factor={self.factor} must be at least 2")
        if not self.hotspare.stragglers.enabled or self.parallel.spares_per_node < 1:
            raise ConfigError("the benchmark needs hotspare.stragglers.enabled=true and parallel.spares_per_node >= 1 "
                              "(a spare to hand the slow rank to)")


ConfigStore.instance().store(name="bench_straggler_schema", node=BenchStragglerConfig)
gpt_job.register()


def rate(ends: dict[int, float], first: int, last: int) -> float | None:
    """Completed steps per second over steps ``first+1..last`` (by their end times)."""
    if first not in ends or last not in ends or last <= first:
        return None
    return (last - first) / (ends[last] - ends[first])


def measure(bench: BenchStragglerConfig, ref: list[dict], got: list[dict]) -> dict:
    # A rank that ran in one process all along (a healthy rank taken for slow was replaced too).
    survivor = next((r for r in got if r["rank"] != bench.slow_rank and not r["spare"]), None)
    if survivor is None:
        raise SystemExit("bench_straggler: every rank was handed over; no rank ran the whole job in one process")
    ends = {int(s): t for s, t in survivor["step_end"].items()}
    ref_ends = {int(s): t for s, t in ref[survivor["rank"]]["step_end"].items()}
    recs = survivor["recoveries"]
    handover = next((r for r in recs if r.get("kind") == "handover"), None)
    before = [ends[s] - ends[s - 1] for s in range(2, bench.slow_step) if s in ends and s - 1 in ends]
    result = {"slow_rank": bench.slow_rank, "slow_step": bench.slow_step, "factor": bench.factor,
              "stragglers": {"factor": bench.hotspare.stragglers.factor, "window": bench.hotspare.stragglers.window},
              "median_step_s": statistics.median(before), "steps_per_s_before": rate(ends, 1, bench.slow_step - 1),
              "handed_over": handover is not None, "recoveries": len(recs),
              "handovers": sum(1 for r in recs if r.get("kind") == "handover")}
    if handover is not None:
        landed = handover["version"]
        around = [ends[s] - ends[s - 1] for s in range(landed - 1, landed + 3) if s in ends and s - 1 in ends]
        result.update(handover_step=landed, detect_steps=landed - bench.slow_step,
                      lost_iterations=max(int(r["failed_at"]) - int(r["version"]) for r in recs),
                      steps_per_s_slow=rate(ends, bench.slow_step, landed - 1),
                      steps_per_s_after=rate(ends, landed + 2, bench.train.steps - 1),
                      handover_pause_s=max(around), handover_total_s=handover["total_s"])
        last = bench.train.steps - 1
        late = max(landed + 2, last - (last - landed) // 2)
        result.update(steps_per_s_late=rate(ends, late, last), ref_steps_per_s_late=rate(ref_ends, late, last))
        if result["steps_per_s_late"] and result["ref_steps_per_s_late"]:
            result["late_vs_uninterrupted"] = result["steps_per_s_late"] / result["ref_steps_per_s_late"]
        result["pause_beyond_step_s"] = result["handover_pause_s"] - result["median_step_s"]
        if result["steps_per_s_after"] and result["steps_per_s_before"]:
            result["after_vs_before"] = result["steps_per_s_after"] / result["steps_per_s_before"]
    result["bitwise_identical"] = all(
        statedigest.differences(a["state_digest"], b["state_digest"]) == []
        and all(a["losses"][k] == v for k, v in b["losses"].items() if k in a["losses"]) for a, b in zip(ref, got))
    return result


@hydra.main(version_base=None, config_path="../configs", config_name="bench_straggler")
def main(cfg) -> None:
    data = OmegaConf.to_container(cfg, resolve=True)
    bench = from_mapping(BenchStragglerConfig, data)
    run_dir = HydraConfig.get().runtime.output_dir
    job = from_mapping(gpt_job.GPTJobConfig, {k: v for k, v in data.items()
                                              if k not in ("out", "slow_rank", "slow_step", "factor")})
    runs = {}
    for name, faults in (("uninterrupted", []), ("slow", [f"slow@forward:{bench.slow_rank}:{bench.slow_step}:"
                                                         f"{bench.factor}"])):
        out = os.path.join(run_dir, name)
        if gpt_job.launch(job, out, mode="hotspare", faults=faults) != 0:
            sys.exit(f"bench_straggler: the {name} run failed; see its output above")
        runs[name] = gpt_job.collect(out, job.parallel.num_ranks)
    result = measure(bench, runs["uninterrupted"], runs["slow"])
    with open(bench.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    for key, value in result.items():
        print(f"{key:<22} {value:.4g}" if isinstance(value, float) else f"{key:<22} {value}")
    print(f"wrote {bench.out}")


if __name__ == "__main__":
    main()
