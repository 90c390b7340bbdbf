"""Reading a job's event logs back: each recovery's phases and a timeline plot.

Every rank writes ``events.rank<R>.jsonl`` (``hotspare.events``) into the configured
``events_dir``; a spare that takes rank R appends to R's file. All timestamps are
``time.monotonic()`` of the machine, so this module compares them only for ranks of one machine
(logical nodes, as the recipes run them); for a real multi-node job each node's clock is its own.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from collections import defaultdict

PHASES = ("detect", "plan", "rebuild", "restore", "resume")
"""A recovery's phases, in order: fault -> first survivor sees it -> plan -> groups rebuilt ->
state restored -> mirroring restarted and training resumed."""


def read_events(directory: str, running: bool = False) -> list[dict]:
    """Every event of every rank under ``directory``, in file order. ``running``: the job still
    writes them, and a line being written (not JSON yet) is skipped instead of raising."""
    rows = []
    for path in sorted(glob.glob(os.path.join(directory, "events.rank*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    if not running:
                        raise
    return rows


def load_events(directory: str) -> list[dict]:
    """Every event of every rank under ``directory``, in time order."""
    return sorted(read_events(directory), key=lambda e: e["t"])


def recoveries(events: list[dict], faults: list[dict] = ()) -> list[dict]:
    """One summary per generation that a recovery started: the boundaries of its phases (the
    slowest rank's, as the job waits for it) and their durations.

    ``faults`` (optional) are injected faults ``{"t": monotonic, "rank": R, "step": S}``; with
    one before a recovery, ``detect`` is measured from it, else that phase is unknown (None).
    """
    by_gen = defaultdict(lambda: defaultdict(list))
    for e in events:
        kind = e["kind"]
        if kind in ("failure_seen", "left"):  # logged in the generation that failed
            by_gen[e["generation"] + 1][kind].append(e)
        elif kind in ("plan", "takeover", "rebuild", "restore", "resume", "fallback"):  # in the new one
            by_gen[e["generation"]][kind].append(e)
    out = []
    for gen in sorted(g for g in by_gen if g):
        ev = by_gen[gen]
        if not ev["resume"]:
            continue  # a recovery that did not finish (the job stopped): no phases to report
        seen = min(e["t"] for e in ev["failure_seen"]) if ev["failure_seen"] else None
        marks = {"seen": seen, "plan": _latest(ev["plan"]), "rebuild": _latest(ev["rebuild"]),
                 "restore": _latest(ev["restore"]), "resume": _latest(ev["resume"])}
        first = seen if seen is not None else min(e["t"] for e in ev["takeover"] or ev["rebuild"])
        before = [f for f in faults if f["t"] <= first]
        fault_t = max(f["t"] for f in before) if before else None
        durations = {
            "detect": None if fault_t is None or seen is None else seen - fault_t,
            "plan": None if seen is None else marks["plan"] - seen,
            "rebuild": marks["rebuild"] - (marks["plan"] if marks["plan"] is not None else first),
            "restore": marks["restore"] - marks["rebuild"],
            "resume": marks["resume"] - marks["restore"],
        }
        start = fault_t if fault_t is not None else first
        resume = ev["resume"][0]
        decided = (ev["plan"] or ev["takeover"] or [{}])[0]
        sources = sorted({e.get("source", "?") for e in ev["restore"]})
        failures = decided.get("failures") or []
        out.append({
            "generation": gen, "version": resume.get("version"), "kind": kind_of(failures), "fault_t": fault_t, "marks": marks,
            "durations": durations, "total": marks["resume"] - start,
            "replaced": decided.get("replaced") or {}, "failures": failures,
            "failed_at": max((e.get("failed_at", -1) for e in ev["resume"]), default=-1),
            "sources": sources, "fallback": ev["fallback"][0].get("checkpoint") if ev["fallback"] else None,
        })
    return out


def kind_of(failures: list[dict]) -> str:
    """'handover' when every rank the plan replaced left on purpose (a straggler, a drain), else 'failure'."""
    return "handover" if failures and all(f.get("reason") == "handover" for f in failures) else "failure"


def _latest(events: list[dict]) -> float | None:
    return max(e["t"] for e in events) if events else None


def print_recoveries(summaries: list[dict], file=None) -> None:
    """The recovery summary table: one block per recovery, each phase's seconds."""
    file = file or sys.stdout
    if not summaries:
        print("recoveries: none", file=file)
        return
    for s in summaries:
        who = ", ".join(f"rank {r} -> {w}" for r, w in sorted(s["replaced"].items())) or "no rank replaced"
        why = ", ".join(f"rank {f['rank']} {f['reason']}" for f in s["failures"]) or "failure"
        back = s["failed_at"] - s["version"] if s["failed_at"] >= 0 else None
        print(f"{s.get('kind', 'failure').replace('failure', 'recovery')} {s['generation']}: {why}; {who}; "
              f"resumed at step {s['version']}"
              + (f" (failed in step {s['failed_at']}: {back} completed step(s) rolled back)" if back is not None else "")
              + (f", from checkpoint {s['fallback']}" if s["fallback"] else f", state from {'/'.join(s['sources'])}"),
              file=file)
        for phase in PHASES:
            d = s["durations"][phase]
            print(f"  {phase:<8} {'unknown' if d is None else f'{d * 1e3:8.1f} ms'}", file=file)
        print(f"  {'total':<8} {s['total'] * 1e3:8.1f} ms  (fault to training resumed)", file=file)


COLORS = {"detect": "#d62728", "plan": "#ff7f0e", "rebuild": "#9467bd", "restore": "#1f77b4", "resume": "#2ca02c"}


def plot_timeline(events: list[dict], summaries: list[dict], path: str, faults: list[dict] = ()) -> str:
    """A PNG of every rank's steps (from ``step`` events) with each recovery's phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e for e in events if e["kind"] == "step"]
    t0 = min([e["t"] - e.get("seconds", 0.0) for e in steps] + [e["t"] for e in events])
    ranks = sorted({e["rank"] for e in events})
    fig, ax = plt.subplots(figsize=(11, 2.0 + 0.45 * len(ranks)))
    workers = sorted({e.get("worker", "") for e in steps})
    shades = {w: ("#7f7f7f" if w.startswith("a") or not w else "#17becf") for w in workers}
    for e in steps:
        start = e["t"] - e.get("seconds", 0.0) - t0
        ax.broken_barh([(start, e.get("seconds", 0.0))], (e["rank"] - 0.35, 0.7), facecolors=shades[e.get("worker", "")],
                       edgecolor="white", linewidth=0.3)
    for s in summaries:
        lo = s["fault_t"] if s["fault_t"] is not None else s["marks"]["seen"]
        bounds = [lo, s["marks"]["seen"], s["marks"]["plan"], s["marks"]["rebuild"], s["marks"]["restore"],
                  s["marks"]["resume"]]
        for phase, a, b in zip(PHASES, bounds, bounds[1:]):
            if a is not None and b is not None and b > a:
                ax.axvspan(a - t0, b - t0, color=COLORS[phase], alpha=0.35, lw=0,
                           label=phase if s is summaries[0] else None)
    for f in faults:
        ax.axvline(f["t"] - t0, color="black", lw=1.2, ls="--")
        ax.annotate(f"SIGKILL rank {f['rank']}", (f["t"] - t0, max(ranks) + 0.45), fontsize=8, ha="right")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(-0.6, max(ranks) + 0.7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first step (grey: original workers' steps, teal: a spare's)")
    title = "hotspare timeline"
    if summaries:
        title += "; " + "; ".join(f"recovery {s['generation']}: {s['total'] * 1e3:.0f} ms" for s in summaries)
    ax.set_title(title, fontsize=10)
    if summaries:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.32), fontsize=8, ncol=len(PHASES), frameon=False,
                  title="recovery phases", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
