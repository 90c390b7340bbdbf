"""Train the GPT smoke model under DeepSpeed ZeRO through hotspare (the main recipe).

    python recipes/train_gpt.py                      # defaults: configs/train_gpt.yaml
    python recipes/train_gpt.py zero=stage3 model=small train.steps=500 parallel.num_ranks=2
    python recipes/train_gpt.py parallel.spares_per_node=1 fault.rank=1 fault.step=150   # make demo

Writes run.json, rank<R>.json, summary.json, events/ and, when a recovery happened (or with
hotspare on), timeline.png into out_dir (default: Hydra's run dir). The summary lists each
recovery's phases and their durations.
"""
from __future__ import annotations

import json
import os
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig

from hotspare.testing import job as gpt_job
from hotspare import report

gpt_job.register()


@hydra.main(version_base=None, config_path="../configs", config_name="train_gpt")
def main(cfg) -> None:
    job = gpt_job.to_job(cfg)
    out_dir = os.path.abspath(job.out_dir or HydraConfig.get().runtime.output_dir)
    t0 = time.monotonic()
    code = gpt_job.launch(job, out_dir)
    if code != 0:
        print(f"train_gpt: the job failed (exit code {code}); see the rank output above", file=sys.stderr)
        sys.exit(code)
    summary = gpt_job.summarize(gpt_job.collect(out_dir, job.parallel.num_ranks), time.monotonic() - t0)
    events_dir = os.path.join(out_dir, "events")
    timeline = None
    if os.path.isdir(events_dir):
        events = report.load_events(events_dir)
        fault_path = os.path.join(out_dir, "fault.json")
        faults = [json.load(open(fault_path, encoding="utf-8"))] if os.path.exists(fault_path) else []
        summary["recoveries"] = report.recoveries(events, faults)
        timeline = report.plot_timeline(events, summary["recoveries"], os.path.join(out_dir, "timeline.png"), faults)
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    gpt_job.print_summary(summary)
    if "recoveries" in summary:
        report.print_recoveries(summary["recoveries"])
    if timeline:
        print(f"timeline: {timeline}")
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
