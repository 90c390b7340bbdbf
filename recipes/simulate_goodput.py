"""Goodput at scale: a seeded failure-and-recovery simulation of a training job on N GPUs
(1,024 to 131,072 by default) for five recovery strategies, with failure rates from Llama 3's
published interruptions and recovery costs grown from this project's measurements
(``hotspare.goodput``, ``hotspare.goodput_model``; the model and its sources: docs/goodput.md).

    python recipes/simulate_goodput.py out=goodput.json
    python recipes/simulate_goodput.py out=g.json calibration=recovery.json      # terms from bench_recovery's JSON
    python recipes/simulate_goodput.py out=g.json seeds=40 num_gpus=[16384,131072] hotspare.tier2=stripe
    python recipes/simulate_goodput.py out=g.json costs.rebuild_growth=linear failures.rate_scale=2

Writes one JSON object: ``results`` (rows of strategy, num_gpus, productive_fraction, ci_low,
ci_high, plus ``lost`` (fraction of wall time per term: detection, rebuild, restore, recompute,
restart, overhead, waiting), ``dominant_loss``, mtbf_s, downtime_s_per_failure, ...),
``validation`` (published points: simulated value, tolerance, pass), ``target``,
``sensitivity``, ``calibration`` and the full ``model``; and a PNG plot (``plot``, default: next
to ``out``). Prints a table.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from hotspare.config import ConfigError, from_mapping
from hotspare.goodput import SimulateGoodputConfig, plot, report
from hotspare.goodput_costs import measured_from_bench


ConfigStore.instance().store(name="simulate_goodput_schema", node=SimulateGoodputConfig)


def calibrated(cfg: SimulateGoodputConfig) -> tuple[SimulateGoodputConfig, dict]:
    """``cfg`` with ``measured`` read from the calibration JSON, if one is named."""
    if not cfg.calibration:
        return cfg, {"path": "", "notes": ["measured terms from the config (docs/recovery.md medians)"]}
    try:
        with open(cfg.calibration, encoding="utf-8") as f:
            bench = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"calibration={cfg.calibration!r}: cannot read it as JSON ({exc}); give the path of a "
                          f"recipes/bench_recovery.py result, or leave calibration empty") from None
    measured, notes = measured_from_bench(bench, cfg.measured)
    return dataclasses.replace(cfg, measured=measured), {"path": os.path.abspath(cfg.calibration), "notes": notes,
                                                         "measured": dataclasses.asdict(measured)}


def print_report(rep: dict, file=sys.stdout) -> None:
    sizes = sorted({r["num_gpus"] for r in rep["results"]})
    print(f"{'strategy':<20}" + "".join(f"{n:>22,}" for n in sizes), file=file)
    for s in dict.fromkeys(r["strategy"] for r in rep["results"]):
        cells = {r["num_gpus"]: r for r in rep["results"] if r["strategy"] == s}
        print(f"{s:<20}" + "".join(f"{cells[n]['productive_fraction']:>9.4f} [{cells[n]['ci_low']:.4f},"
                                  f"{cells[n]['ci_high']:.4f}]" for n in sizes), file=file)
    print("dominant loss at the largest size: " + ", ".join(
        f"{r['strategy']} {r['dominant_loss']}" for r in rep["results"] if r["num_gpus"] == sizes[-1]), file=file)
    for v in rep["validation"]:
        print(f"validation {v['name']}: {v['strategy']} at {v['num_gpus']:,} GPUs simulated {v['simulated']:.4f}, "
              f"published {v['published']} (tolerance {v['tolerance']}): {'PASS' if v['pass'] else 'FAIL'}", file=file)
    t = rep["target"]
    lost = ", ".join(f"{k} {v:.4f}" for k, v in sorted(t["lost"].items(), key=lambda kv: -kv[1]) if v > 0)
    print(f"target {t['strategy']} >= {t['at_least']} at {t['num_gpus']:,} GPUs: {t['simulated']:.4f} "
          f"[{t['ci_low']:.4f}, {t['ci_high']:.4f}] {'MET' if t['pass'] else 'NOT MET'}; lost: {lost}", file=file)
    for s in rep["sensitivity"]:
        print(f"sensitivity {s['name']}: {s['strategy']} at {s['num_gpus']:,} {s['productive_fraction']:.4f} "
              f"(default {s['default_fraction']:.4f}; dominant {s['dominant_loss']})", file=file)


@hydra.main(version_base=None, config_path="../configs", config_name="simulate_goodput")
def main(cfg) -> None:
    start = time.monotonic()
    job = from_mapping(SimulateGoodputConfig, OmegaConf.to_container(cfg, resolve=True))
    job, calibration = calibrated(job)
    rep = report(job)
    rep["calibration"] = calibration
    png = job.plot or os.path.splitext(job.out)[0] + ".png"
    plot(rep, png)
    rep["plot"] = os.path.abspath(png)
    rep["runtime_s"] = time.monotonic() - start
    with open(job.out, "w", encoding="utf-8") as f:
        json.dump(rep, f, indent=1)
    print_report(rep)
    print(f"wrote {os.path.abspath(job.out)} and {rep['plot']} in {rep['runtime_s']:.1f} s")


if __name__ == "__main__":
    main()
