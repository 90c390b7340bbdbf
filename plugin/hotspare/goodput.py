"""The goodput simulator: seeded failure traces on N GPUs, one event loop for every recovery
strategy, productive-time fractions with confidence intervals over seeds, the term that dominates
the loss, and checks against published points (``docs/goodput.md``).

Pure and seeded: no torch, no processes. The cost of each failure comes from
``hotspare.goodput_costs.plan``; this module only draws the failures and keeps the accounts.
Wall time is partitioned exactly into productive time and the loss terms of
``goodput_model.TERMS``, so the fractions of a run sum to 1.
"""
from __future__ import annotations

import heapq
import json
import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from hotspare.config import ConfigError, check_choice, from_mapping, to_mapping
from hotspare.goodput_costs import Plan, plan
from hotspare.goodput_model import SECONDS_PER_DAY, STRATEGIES, TERMS, GoodputModel


@dataclass
class PublishedPoint:
    """A published productive-time figure the simulator must reproduce."""

    name: str
    """Label in the output."""
    source: str
    """Where the figure is published."""
    strategy: str
    """The strategy of this simulator that models the published system."""
    num_gpus: int
    """Scale of the published figure."""
    at_least: float
    """The published lower bound ('above 90%' is 0.90)."""
    tolerance: float = 0.02
    """The point holds when the simulated mean is >= at_least - tolerance."""


def published_points() -> list[PublishedPoint]:
    return [PublishedPoint("llama3_effective_training_time",
                           "Dubey et al., The Llama 3 Herd of Models, arXiv 2407.21783, "
                           "sec. 3.3.4: higher than 90% effective training time; all but"
                           " three of the 419 interruptions handled by automation",
                           "checkpoint_restart", 16384, 0.90),
            PublishedPoint("leto_productive_time",
                           "Leto, arXiv 2610.00687: over 95% productive time at 131,072 "
                           "GPUs for its design (as cited by issue 8; not re-read here)",
                           "leto_like", 131072, 0.95)]


@dataclass
class Target:
    """The goal the issue sets: a strategy's fraction at a scale."""

    strategy: str = "hotspare"
    """Strategy the target is for."""
    num_gpus: int = 131072
    """Scale."""
    at_least: float = 0.97
    """Required simulated mean productive fraction."""


@dataclass
class Sensitivity:
    """One strategy at one scale under changed parameters (what a conclusion depends on)."""

    name: str
    """Label in the output."""
    strategy: str
    """Strategy to simulate."""
    num_gpus: int
    """Scale."""
    overrides: list[str]
    """'dotted.key=value' changes to the model, e.g. 'costs.rebuild_growth=linear'."""


@dataclass
class GoodputConfig(GoodputModel):
    """The model plus the experiment: scales, strategies, period, seeds, checks."""

    num_gpus: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536, 131072])
    """Job sizes to simulate."""
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))
    """Strategies to simulate."""
    days: float = 30.0
    """Simulated wall-clock period per run."""
    seeds: int = 20
    """Runs (independent failure traces) per strategy and size."""
    seed: int = 0
    """Base seed; run i of size N draws from numpy's generator seeded with (seed, i, N)."""
    confidence: float = 0.95
    """Level of the t-interval over seeds."""
    validation: list[PublishedPoint] = field(default_factory=published_points)
    """Published points to check."""
    target: Target = field(default_factory=Target)
    """The issue's target."""
    sensitivity: list[Sensitivity] = field(default_factory=list)
    """Extra runs under changed parameters."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for i, n in enumerate(self.num_gpus):
            self.job.check_gpus(n, f"num_gpus[{i}]")
        for i, s in enumerate(self.strategies):
            check_choice(f"strategies[{i}]", s, STRATEGIES)
        if not self.num_gpus or not self.strategies:
            raise ConfigError("num_gpus and strategies must each name at least one entry")
        if not self.days > 0 or self.seeds < 2:
            raise ConfigError(f"days={self.days} must be > 0 and seeds={self.seeds} at least 2 (for an interval)")
        if not 0 < self.confidence < 1:
            raise ConfigError(f"confidence={self.confidence} must be in (0, 1)")
        checks = (("validation", self.validation), ("sensitivity", self.sensitivity), ("target", [self.target]))
        for key, items in checks:
            for i, item in enumerate(items):
                where = key if key == "target" else f"{key}[{i}]"
                check_choice(f"{where}.strategy", item.strategy, STRATEGIES)
                self.job.check_gpus(item.num_gpus, f"{where}.num_gpus")


@dataclass
class SimulateGoodputConfig(GoodputConfig):
    """recipes/simulate_goodput.py's config: the simulator's model and experiment, and where the results go."""

    out: str = "goodput.json"
    """Where the JSON result goes."""
    plot: str = ""
    """Where the PNG goes; empty: ``out`` with the extension .png."""
    calibration: str = ""
    """A recipes/bench_recovery.py JSON whose measured detect/rebuild/restore terms replace ``measured``
    (the keeper, hotspare and stripe ways); empty: the values under ``measured``."""


@dataclass(frozen=True)
class Trace:
    """Failures of one run: arrival times, class index, and three uniforms per failure (the part of the
    iteration in flight, whether the newest version was lost, the place in an in-memory checkpoint window)."""

    times: np.ndarray
    classes: np.ndarray
    inflight: np.ndarray
    extra: np.ndarray
    window: np.ndarray


def failure_trace(model: GoodputModel, num_gpus: int, horizon_s: float, seed: int, run: int) -> Trace:
    """Poisson arrivals per class at a constant per-GPU rate (so linear in ``num_gpus``). Every strategy
    sees the same trace for the same (seed, run, num_gpus): differences between them are not noise."""
    rng = np.random.default_rng([seed, run, num_gpus])
    rates = np.array(model.failures.rates_per_gpu_s()) * num_gpus
    total = float(rates.sum())
    count = int(rng.poisson(total * horizon_s)) if total > 0 else 0
    times = np.sort(rng.uniform(0.0, horizon_s, count))
    classes = rng.choice(len(rates), size=count, p=rates / total) if count else np.zeros(0, dtype=int)
    return Trace(times, classes, rng.uniform(size=count), rng.uniform(size=count), rng.uniform(size=count))


def run(p: Plan, trace: Trace, horizon_s: float) -> dict[str, float]:
    """Seconds of productive time and of each loss term over one run; they sum to the wall time
    (the horizon, or later if the last recovery ends after it). A failure that strikes during a
    recovery is handled after it."""
    acc = dict.fromkeys(TERMS, 0.0)
    productive = 0.0
    it, o, tau, ckpt = p.iteration_s, p.overhead_fraction, p.checkpoint_interval_s, p.checkpoint_s
    classes = p.classes
    pool, pending = p.spare_pool, []
    ready = 0.0

    def train(up: float, lost_s: float, failed: bool = True) -> None:
        """An up period of ``up`` wall seconds, ended by a failure (``failed``) that loses ``lost_s`` of
        compute, or by the end of the run. Checkpoint-restart loses everything since its checkpoint."""
        nonlocal productive
        if tau > 0:  # checkpoint-restart: compute tau, write for ckpt, repeat; each restart begins a cycle
            cycles = math.floor(up / (tau + ckpt))  # 0 when nothing fails (tau is infinite)
            rest = up - cycles * (tau + ckpt) if cycles else up
            if cycles:
                productive += cycles * tau
                acc["overhead"] += cycles * ckpt
            acc["overhead"] += max(0.0, rest - tau)
            lost = min(rest, tau) if failed else 0.0
            acc["recompute"] += lost
            productive += min(rest, tau) - lost
        else:
            compute = up * (1.0 - o)
            acc["overhead"] += up * o
            lost = min(compute, lost_s)
            acc["recompute"] += lost
            productive += compute - lost

    for t, ci, inflight, extra, window in zip(trace.times.tolist(), trace.classes.tolist(), trace.inflight.tolist(),
                                              trace.extra.tolist(), trace.window.tolist()):
        c = classes[ci]
        if t > ready:
            lost_iterations = inflight + (extra < c.extra_lost_p) + math.floor(window * p.window_iterations)
            train(t - ready, lost_iterations * it)
        start = max(t, ready)
        waiting = c.waiting
        if c.needs_spare:
            while pending and pending[0] <= start:
                heapq.heappop(pending)
                pool = min(p.spare_pool, pool + 1)
            if pool > 0:
                pool -= 1
                waiting = 0.0
            elif pending and pending[0] - start < p.cold_replace_s:
                waiting = heapq.heappop(pending) - start  # the next replacement arrives before a cold node
            else:
                waiting = p.cold_replace_s
            if p.spare_pool > 0:
                heapq.heappush(pending, start + p.spare_replenish_s)
        acc["detection"] += c.detection
        acc["rebuild"] += c.rebuild
        acc["restore"] += c.restore
        acc["restart"] += c.restart
        acc["waiting"] += waiting
        ready = start + c.detection + c.rebuild + c.restore + c.restart + waiting
    if horizon_s > ready:
        train(horizon_s - ready, 0.0, failed=False)
    acc["productive"] = productive
    return acc


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (exact for df 1 and 2; Cornish-Fisher expansion, error < 1e-3 for df >= 3)."""
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


def mean_interval(values: list[float], confidence: float) -> tuple[float, float, float]:
    """Mean and its two-sided t-interval over independent runs."""
    mean = statistics.fmean(values)
    half = t_quantile(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def simulate(cfg: GoodputConfig, strategy: str, num_gpus: int) -> dict:
    """One row: ``strategy`` on ``num_gpus`` GPUs over ``cfg.seeds`` runs."""
    p = plan(cfg, strategy, num_gpus)
    horizon = cfg.days * SECONDS_PER_DAY
    runs = [run(p, failure_trace(cfg, num_gpus, horizon, cfg.seed, i), horizon) for i in range(cfg.seeds)]
    walls = [sum(r.values()) for r in runs]
    fractions = [r["productive"] / w for r, w in zip(runs, walls)]
    mean, low, high = mean_interval(fractions, cfg.confidence)
    lost = {term: statistics.fmean(r[term] / w for r, w in zip(runs, walls)) for term in TERMS}
    mtbf = cfg.failures.mtbf_s(num_gpus)
    rates = cfg.failures.rates_per_gpu_s()
    # mean downtime per failure (the spare pool's waits excluded): R of the closed form
    downtimes = [c.detection + c.rebuild + c.restore + c.restart + c.waiting for c in p.classes]
    per_failure = sum(r * d for r, d in zip(rates, downtimes)) / sum(rates) if sum(rates) else 0.0
    row = {"strategy": strategy, "num_gpus": num_gpus, "productive_fraction": mean, "ci_low": low, "ci_high": high,
           "seeds": cfg.seeds, "lost": lost, "dominant_loss": max(lost, key=lost.get) if mean < 1 else None,
           "mtbf_s": mtbf, "failures_per_day": SECONDS_PER_DAY / mtbf if mtbf < math.inf else 0.0,
           "downtime_s_per_failure": per_failure, "overhead_per_iteration": p.overhead_fraction}
    if strategy == "checkpoint_restart":
        # Young's first-order expectation, for comparison: 1 - C/T - (T/2 + R)/M
        row.update(checkpoint_interval_s=p.checkpoint_interval_s, checkpoint_s=p.checkpoint_s,
                   closed_form=closed_form_checkpoint_restart(p.checkpoint_s, p.checkpoint_interval_s, per_failure,
                                                              mtbf))
    if strategy == "hotspare":
        row.update(spare_nodes=p.spare_pool,
                   spare_gpu_fraction=p.spare_pool * cfg.job.gpus_per_node / num_gpus)
    return row


def closed_form_checkpoint_restart(checkpoint_s: float, interval_s: float, downtime_s: float, mtbf_s: float) -> float:
    """Young's first-order productive fraction of checkpoint-restart: 1 - C/T - (T/2 + R)/M."""
    if math.isinf(mtbf_s):
        return 1.0
    return 1.0 - checkpoint_s / interval_s - (interval_s / 2 + downtime_s) / mtbf_s


def with_overrides(cfg: GoodputConfig, overrides: list[str]) -> GoodputConfig:
    """A validated copy of ``cfg`` with 'dotted.key=value' changes (values parsed as JSON, else strings)."""
    data = to_mapping(cfg)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected 'dotted.key=value'")
        *sections, leaf = key.split(".")
        node = data
        for part in sections:
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"override {item!r}: no section {part!r}")
            node = node[part]
        if leaf not in node:
            raise ConfigError(f"override {item!r}: unknown key {key!r}")
        try:
            node[leaf] = json.loads(text)
        except json.JSONDecodeError:
            node[leaf] = text
    return from_mapping(type(cfg), data)


def report(cfg: GoodputConfig) -> dict:
    """Every row of the grid, the validation points, the target and the sensitivity runs."""
    rows = {(s, n): simulate(cfg, s, n) for s in cfg.strategies for n in cfg.num_gpus}

    def row(strategy: str, num_gpus: int) -> dict:
        if (strategy, num_gpus) not in rows:
            rows[(strategy, num_gpus)] = simulate(cfg, strategy, num_gpus)
        return rows[(strategy, num_gpus)]

    validation = []
    for v in cfg.validation:
        r = row(v.strategy, v.num_gpus)
        validation.append({"name": v.name, "source": v.source, "strategy": v.strategy, "num_gpus": v.num_gpus,
                           "published": f">= {v.at_least}", "tolerance": v.tolerance,
                           "simulated": r["productive_fraction"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                           "pass": r["productive_fraction"] >= v.at_least - v.tolerance})
    t = cfg.target
    r = row(t.strategy, t.num_gpus)
    target = {"strategy": t.strategy, "num_gpus": t.num_gpus, "at_least": t.at_least,
              "simulated": r["productive_fraction"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
              "pass": r["productive_fraction"] >= t.at_least, "dominant_loss": r["dominant_loss"], "lost": r["lost"]}
    sensitivity = []
    for s in cfg.sensitivity:
        alt = simulate(with_overrides(cfg, s.overrides), s.strategy, s.num_gpus)
        base = row(s.strategy, s.num_gpus)
        sensitivity.append({"name": s.name, "strategy": s.strategy, "num_gpus": s.num_gpus, "overrides": s.overrides,
                            "productive_fraction": alt["productive_fraction"], "ci_low": alt["ci_low"],
                            "ci_high": alt["ci_high"], "dominant_loss": alt["dominant_loss"],
                            "default_fraction": base["productive_fraction"]})
    results = [rows[(s, n)] for s in cfg.strategies for n in cfg.num_gpus]
    return {"results": results, "validation": validation, "target": target, "sensitivity": sensitivity,
            "days": cfg.days, "seeds": cfg.seeds, "confidence": cfg.confidence, "model": to_mapping(cfg)}


def plot(rep: dict, path: str) -> None:
    """Productive fraction against N per strategy with interval bars, and the loss terms at the
    largest N (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = list(dict.fromkeys(r["strategy"] for r in rep["results"]))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    for s in strategies:
        rows = sorted((r for r in rep["results"] if r["strategy"] == s), key=lambda r: r["num_gpus"])
        x = [r["num_gpus"] for r in rows]
        y = [r["productive_fraction"] for r in rows]
        err = [[r["productive_fraction"] - r["ci_low"] for r in rows],
               [r["ci_high"] - r["productive_fraction"] for r in rows]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=s)
    t = rep["target"]
    ax.axhline(t["at_least"], color="grey", linestyle=":", linewidth=1)
    ax.annotate(f"target {t['strategy']} >= {t['at_least']}", (min(r["num_gpus"] for r in rep["results"]),
                                                               t["at_least"]), fontsize=8, va="bottom")
    for i, v in enumerate(rep["validation"]):
        ax.plot(v["num_gpus"], v["simulated"], marker="*", markersize=12, color="black", linestyle="none",
                label="simulated, published point" if i == 0 else None)
        ax.plot(v["num_gpus"], float(v["published"].split()[-1]), marker="v", markersize=8, markerfacecolor="none",
                color="black", linestyle="none", label="published lower bound" if i == 0 else None)
        ax.annotate(f"{v['name']} ({v['published']}: {'pass' if v['pass'] else 'FAIL'})",
                    (v["num_gpus"], v["simulated"]), fontsize=7, xytext=(-150, -14), textcoords="offset points")
    sizes = sorted({r["num_gpus"] for r in rep["results"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel("productive fraction of wall time")
    ax.set_title(f"Simulated goodput ({rep['days']:g} days, {rep['seeds']} seeds, {rep['confidence']:.0%} CI)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    n = max(r["num_gpus"] for r in rep["results"])
    rows = [next(r for r in rep["results"] if r["strategy"] == s and r["num_gpus"] == n) for s in strategies]
    bottom = np.zeros(len(rows))
    for term in TERMS:
        vals = np.array([r["lost"][term] for r in rows])
        bx.bar(range(len(rows)), vals, bottom=bottom, label=term)
        bottom += vals
    bx.set_xticks(range(len(rows)), [s.replace("_", "\n") for s in strategies], fontsize=8)
    bx.set_ylabel("lost fraction of wall time")
    bx.set_title(f"Where the time goes at {n:,} GPUs")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
