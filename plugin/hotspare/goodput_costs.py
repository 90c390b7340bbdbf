"""What one failure costs each recovery strategy, term by term: ``plan(model, strategy, num_gpus)``
turns the model (:mod:`hotspare.goodput_model`) into the constants the event loop in
``hotspare.goodput`` needs: per failure class the seconds of detection, rebuild, restore, restart
and waiting, the chance of one extra lost iteration, and the per-iteration overhead; and
:func:`measured_from_bench` reads the measured terms from a recipes/bench_recovery.py JSON.
Pure functions (``docs/goodput.md``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hotspare.config import ConfigError, check_choice

from .goodput_model import GB, RECOVERY_KINDS, STRATEGIES, GoodputModel, InPlaceModel, Measured, MeasuredWay


@dataclass(frozen=True)
class ClassCost:
    """What one failure of a class costs a strategy, in seconds per term (recompute excluded)."""

    detection: float
    rebuild: float
    restore: float
    restart: float
    waiting: float
    """Fixed wait for a replacement (cold start); the spare pool's wait is added by the event loop."""
    needs_spare: bool
    """Takes a node from the spare pool (hotspare, node loss)."""
    extra_lost_p: float
    """Chance that the newest version was not yet safe: one more iteration is re-run."""


@dataclass(frozen=True)
class Plan:
    """A strategy's constants at one GPU count: what the event loop reads."""

    strategy: str
    num_gpus: int
    iteration_s: float
    overhead_fraction: float
    """Share of training wall time spent on per-iteration protection (mirror, in-memory checkpoint)."""
    classes: tuple[ClassCost, ...]
    checkpoint_interval_s: float = 0.0
    """checkpoint_restart: compute seconds between checkpoints (0 for the others)."""
    checkpoint_s: float = 0.0
    """checkpoint_restart: blocking seconds per checkpoint."""
    window_iterations: int = 1
    """gemini_like: iterations between in-memory checkpoints (lost work is uniform over them)."""
    spare_pool: int = 0
    spare_replenish_s: float = 0.0
    cold_replace_s: float = 0.0


def rebuild_s(model: GoodputModel, base_s: float, num_gpus: int) -> float:
    """Group creation at ``num_gpus``: the measured base at the benchmark's size, grown by the model."""
    c, n0 = model.costs, model.measured.num_ranks
    if c.rebuild_growth == "log":
        return base_s + c.rebuild_per_doubling_s * max(0.0, math.log2(num_gpus / n0))
    return base_s + c.rebuild_per_gpu_s * max(0, num_gpus - n0)


def detection_s(model: GoodputModel, detector: str, crash_s: float) -> float:
    return {"crash": crash_s, "heartbeat": model.costs.heartbeat_timeout_s,
            "collective": model.costs.collective_timeout_s}[detector]


def checkpoint_cost_s(model: GoodputModel, num_gpus: int) -> float:
    """Blocking cost C of one persistent checkpoint: all ranks write at once, bound by the storage's
    aggregate bandwidth (or a GPU's NIC share, whichever is slower)."""
    j = model.job
    total = j.checkpoint_bytes_per_param * j.model_params
    return model.checkpoint_restart.checkpoint_fixed_s + max(total / (j.storage_write_gbs * GB),
                                                             total / num_gpus / (j.nic_gbps / 8 * GB))


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints: sqrt(2 C M)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def _in_place(model: GoodputModel, cfg: InPlaceModel, num_gpus: int, hot: bool) -> Plan:
    """hotspare (hot=True) or Leto-like (hot=False: cold replacements, no spare pool)."""
    j, m, c = model.job, model.measured, model.costs
    unique = j.unique_bytes_per_param * j.model_params / num_gpus
    nic, host = j.nic_gbps / 8 * GB, j.host_link_gbs * GB
    net_bytes = unique * (cfg.replicas if cfg.tier2 == "mirror" else (cfg.k + cfg.m - 1) / cfg.k)
    capture = m.capture_s + unique / host
    # The step's own cost of the capture (the unprotected window below still runs to the copy's end).
    stall = m.capture_s + max(0.0, unique / host - j.iteration_s) if hot and c.copy_overlapped else capture
    per_iter = stall + c.mirror_interference * net_bytes / nic
    # The newest version is lost with the rank while its copy is still on the way to the holders;
    # the keeper is sealed right after the capture on the training thread (docs/recovery.md).
    window_p = min(1.0, (capture + net_bytes / nic) / j.iteration_s)
    keeper_p = min(1.0, capture / j.iteration_s)
    tier2 = m.peers if cfg.tier2 == "mirror" else m.stripe
    cold = c.node_allocate_s + c.process_start_s
    costs = []
    for fc in model.failures.classes:
        if fc.recovery == "process":
            way, restore, p = (m.keeper, m.keeper.restore_s + unique / host, keeper_p) if cfg.keeper else \
                (m.peers, m.peers.restore_s + unique / nic, window_p)
            # hotspare: the node's pre-started spare takes the rank; Leto-like restarts the process cold.
            costs.append(ClassCost(detection_s(model, fc.detect, way.detect_s),
                                   rebuild_s(model, way.rebuild_s, num_gpus), restore,
                                   0.0 if hot else c.process_start_s, 0.0, False, p))
        elif fc.recovery == "node":
            costs.append(ClassCost(detection_s(model, fc.detect, tier2.detect_s),
                                   rebuild_s(model, tier2.rebuild_s, num_gpus), tier2.restore_s + unique / nic,
                                   0.0, 0.0 if hot else cold, hot, window_p))
        else:  # the same workers re-form their groups; each keeps its own state
            costs.append(ClassCost(detection_s(model, fc.detect, m.peers.detect_s),
                                   rebuild_s(model, m.peers.rebuild_s, num_gpus), m.peers.restore_s, 0.0, 0.0,
                                   False, window_p))
    spares = math.ceil(cfg.spare_nodes_per_1024_gpus * num_gpus / 1024) if hot else 0
    return Plan("hotspare" if hot else "leto_like", num_gpus, j.iteration_s, per_iter / (j.iteration_s + per_iter),
                tuple(costs), spare_pool=spares, spare_replenish_s=cfg.spare_replenish_s, cold_replace_s=cold)


def _restart(model: GoodputModel, strategy: str, num_gpus: int) -> Plan:
    """Every failure restarts the whole job on healthy nodes; strategies differ in where state comes from."""
    j, m, c = model.job, model.measured, model.costs
    nic, host = j.nic_gbps / 8 * GB, j.host_link_gbs * GB
    rebuild = rebuild_s(model, m.peers.rebuild_s, num_gpus)
    unique = j.unique_bytes_per_param * j.model_params / num_gpus
    ckpt = j.checkpoint_bytes_per_param * j.model_params / num_gpus
    overhead, p, interval, ckpt_s, window = 0.0, 0.0, 0.0, 0.0, 1
    if strategy == "checkpoint_restart":
        ckpt_s = checkpoint_cost_s(model, num_gpus)
        interval = model.checkpoint_restart.interval_s or young_interval_s(ckpt_s, model.failures.mtbf_s(num_gpus))
        restore = {kind: max(ckpt * num_gpus / (j.storage_read_gbs * GB), ckpt / nic) for kind in RECOVERY_KINDS}
    elif strategy == "gemini_like":
        g = model.gemini_like
        per_ckpt = m.capture_s + ckpt / host + c.mirror_interference * g.replicas * ckpt / nic
        per_iter = per_ckpt / g.every_iterations
        overhead = per_iter / (j.iteration_s + per_iter)
        p, window = min(1.0, per_ckpt / j.iteration_s), g.every_iterations
        # a process fault reloads from the node's own CPU memory; a lost node's from a peer's
        restore = {"process": ckpt / host, "node": ckpt / nic + ckpt / host, "network": ckpt / host}
    else:  # fftrainer_like: per-iteration mirror of the unique state in a neighbour, then restart
        per_iter = m.capture_s + unique / host + c.mirror_interference * unique / nic
        overhead = per_iter / (j.iteration_s + per_iter)
        p = min(1.0, (m.capture_s + unique / host + unique / nic) / j.iteration_s)
        restore = {kind: m.peers.restore_s + unique / nic for kind in RECOVERY_KINDS}
    costs = tuple(ClassCost(detection_s(model, fc.detect, m.peers.detect_s), rebuild, restore[fc.recovery],
                            c.job_restart_s, 0.0, False, p) for fc in model.failures.classes)
    return Plan(strategy, num_gpus, j.iteration_s, overhead, costs, checkpoint_interval_s=interval,
                checkpoint_s=ckpt_s, window_iterations=window)


def plan(model: GoodputModel, strategy: str, num_gpus: int) -> Plan:
    """The constants of ``strategy`` on ``num_gpus`` GPUs (pure)."""
    check_choice("strategy", strategy, STRATEGIES)
    model.job.check_gpus(num_gpus)
    if strategy == "hotspare":
        return _in_place(model, model.hotspare, num_gpus, hot=True)
    if strategy == "leto_like":
        return _in_place(model, model.leto_like, num_gpus, hot=False)
    return _restart(model, strategy, num_gpus)


def measured_from_bench(bench: Mapping, base: Measured) -> tuple[Measured, list[str]]:
    """``base`` with the terms a recipes/bench_recovery.py JSON measured: 'keeper', 'hotspare' (the
    peers way) and 'stripe' (each: detect_s, rebuild_s, restore_s). Returns notes on what was kept."""
    if not isinstance(bench, Mapping):
        raise ConfigError(f"calibration: expected a JSON object, got {type(bench).__name__}")
    notes, ways = [], {}
    for field_name, key in (("keeper", "keeper"), ("peers", "hotspare"), ("stripe", "stripe")):
        entry = bench.get(key)
        if entry is None:
            notes.append(f"calibration has no {key!r} way: measured.{field_name} keeps its configured values")
            ways[field_name] = getattr(base, field_name)
            continue
        missing = [k for k in ("detect_s", "rebuild_s", "restore_s") if not isinstance(entry.get(k), (int, float))]
        if missing:
            raise ConfigError(f"calibration: way {key!r} lacks {', '.join(missing)}; is it a recipes/bench_recovery.py "
                              f"JSON?")
        ways[field_name] = MeasuredWay(float(entry["detect_s"]), float(entry["rebuild_s"]), float(entry["restore_s"]))
    if not isinstance(bench.get("num_ranks"), int):
        raise ConfigError("calibration: no integer 'num_ranks'; is it a recipes/bench_recovery.py JSON?")
    return Measured(num_ranks=bench["num_ranks"], capture_s=base.capture_s, **ways), notes
