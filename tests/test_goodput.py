"""The goodput simulator (hotspare.goodput, hotspare.goodput_model, recipes/simulate_goodput.py):
closed-form cases (a failure-free run is 1 minus the per-iteration overhead; Young's interval
sqrt(2 C M) is the one chosen, and checkpoint-restart's simulated goodput is close to
1 - C/T - (T/2 + R)/M), determinism, the partition of wall time into terms, more spares never
hurting hotspare, the published validation points and the issue's target under the default
model, strict config errors naming the key, calibration from a bench_recovery JSON, the
recipe's YAML against its schema, and the plot. Pure functions: no process, no network; needs
numpy, and matplotlib for the plot test."""
from __future__ import annotations

import math

import pytest

from hotspare.config import ConfigError, from_mapping, to_mapping
from hotspare.goodput import (GoodputConfig, SimulateGoodputConfig, closed_form_checkpoint_restart, failure_trace,
                              mean_interval, plot, report, run, simulate, t_quantile, with_overrides)
from hotspare.goodput_costs import checkpoint_cost_s, measured_from_bench, plan, rebuild_s, young_interval_s
from hotspare.goodput_model import STRATEGIES, TERMS, Measured

DEFAULTS = GoodputConfig()


def small(*overrides: str) -> GoodputConfig:
    return with_overrides(DEFAULTS, ["seeds=4", "days=5", "num_gpus=[1024]", *overrides])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_failure_free_run_loses_only_the_per_iteration_overhead(strategy):
    cfg = small("failures.rate_scale=0")
    row = simulate(cfg, strategy, 1024)
    assert row["productive_fraction"] == pytest.approx(1.0 - row["overhead_per_iteration"], rel=1e-12)
    assert row["ci_low"] == pytest.approx(row["ci_high"])
    if strategy == "checkpoint_restart":
        assert row["productive_fraction"] == 1.0  # nothing fails: no checkpoint is ever due
    assert all(v == 0 for k, v in row["lost"].items() if k != "overhead")


def test_the_checkpoint_interval_is_youngs_optimum():
    for n in DEFAULTS.num_gpus:
        p = plan(DEFAULTS, "checkpoint_restart", n)
        c, m = checkpoint_cost_s(DEFAULTS, n), DEFAULTS.failures.mtbf_s(n)
        assert p.checkpoint_s == c
        assert p.checkpoint_interval_s == pytest.approx(math.sqrt(2 * c * m), rel=1e-12)
    assert young_interval_s(2.0, 100.0) == pytest.approx(20.0)
    fixed = plan(with_overrides(DEFAULTS, ["checkpoint_restart.interval_s=123"]), "checkpoint_restart", 1024)
    assert fixed.checkpoint_interval_s == 123


def test_checkpoint_restart_matches_the_closed_form_with_many_failures():
    # MTBF about an hour at 1,024 GPUs, a 10 s checkpoint, a 2-minute restart: thousands of failures
    cfg = small("failures.rate_scale=50", "checkpoint_restart.checkpoint_fixed_s=7.2", "costs.job_restart_s=120",
                "days=120", "seeds=3")
    row = simulate(cfg, "checkpoint_restart", 1024)
    p = plan(cfg, "checkpoint_restart", 1024)
    assert row["failures_per_day"] * cfg.days > 2000
    expected = closed_form_checkpoint_restart(p.checkpoint_s, p.checkpoint_interval_s,
                                              row["downtime_s_per_failure"], row["mtbf_s"])
    assert 0.8 < expected < 0.95
    assert row["productive_fraction"] == pytest.approx(expected, abs=0.02)
    assert row["closed_form"] == pytest.approx(expected)


def test_same_seed_same_result_other_seed_other_result():
    cfg = small()
    a, b = simulate(cfg, "hotspare", 1024), simulate(cfg, "hotspare", 1024)
    assert a == b
    c = simulate(with_overrides(cfg, ["seed=1"]), "hotspare", 1024)
    assert c["productive_fraction"] != a["productive_fraction"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_wall_time_is_partitioned_into_productive_time_and_the_terms(strategy):
    cfg = small("failures.rate_scale=20", "num_gpus=[16384]")
    horizon = cfg.days * 86400
    p = plan(cfg, strategy, 16384)
    acc = run(p, failure_trace(cfg, 16384, horizon, 0, 0), horizon)
    assert set(acc) == set(TERMS) | {"productive"}
    assert all(v >= 0 for v in acc.values())
    # the runs tile the horizon; only the last recovery may spill over it
    assert sum(acc.values()) >= horizon * (1 - 1e-12)
    assert sum(acc.values()) == pytest.approx(horizon, rel=1e-3)
    row = simulate(cfg, strategy, 16384)
    assert row["productive_fraction"] + sum(row["lost"].values()) == pytest.approx(1.0, abs=1e-9)


def test_lost_work_is_at_most_the_iteration_in_flight_for_in_place_recovery():
    cfg = small("failures.rate_scale=20")
    for strategy in ("hotspare", "leto_like"):
        row = simulate(cfg, strategy, 1024)
        failures = row["failures_per_day"] * cfg.days
        p = plan(cfg, strategy, 1024)
        bound = failures * (1 + max(c.extra_lost_p for c in p.classes)) * p.iteration_s / (cfg.days * 86400)
        assert row["lost"]["recompute"] < 1.5 * bound


def test_more_spares_never_hurt_hotspare():
    cfg = with_overrides(DEFAULTS, ["seeds=6", "days=10"])
    fractions = [simulate(with_overrides(cfg, [f"hotspare.spare_nodes_per_1024_gpus={s}"]), "hotspare", 131072)
                 for s in (0, 0.0078125, 0.03125, 1.0)]
    values = [r["productive_fraction"] for r in fractions]
    assert values == sorted(values)
    assert values[0] < values[-1] - 0.02  # without spares, node losses wait for cold replacements
    assert fractions[0]["dominant_loss"] == "waiting" and fractions[-1]["lost"]["waiting"] == 0


def test_hotspare_beats_every_other_strategy_at_scale_under_the_defaults():
    rows = {s: simulate(DEFAULTS, s, 131072)["productive_fraction"] for s in STRATEGIES}
    assert max(rows, key=rows.get) == "hotspare"
    assert rows["checkpoint_restart"] < rows["gemini_like"] < rows["leto_like"] < rows["hotspare"]


def test_the_target_row_says_what_dominates_hotspares_loss():
    rep = report(with_overrides(DEFAULTS, ["num_gpus=[131072]", "strategies=[\"hotspare\"]", "validation=[]"]))
    t = rep["target"]
    assert t["simulated"] == rep["results"][0]["productive_fraction"]
    assert t["dominant_loss"] == "rebuild"
    assert t["lost"]["rebuild"] > 0.5 * (1 - t["simulated"])


@pytest.mark.xfail(strict=True, reason="hotspare simulates 0.967 at 131,072 GPUs under the default cost model, below "
                                       "the issue's 0.97: the group rebuild (2.5 s per doubling, TrainMover's anchor) "
                                       "dominates; it is met at <= 2.2 s per doubling (docs/goodput.md)")
def test_target_hotspare_at_least_0_97_at_131072_gpus():
    row = simulate(DEFAULTS, "hotspare", 131072)
    assert row["productive_fraction"] >= 0.97


def test_validation_llama3_effective_training_time_above_90_percent():
    rep = report(with_overrides(DEFAULTS, ["num_gpus=[16384]", "strategies=[\"checkpoint_restart\"]"]))
    v = next(v for v in rep["validation"] if v["name"] == "llama3_effective_training_time")
    assert v["pass"] and v["simulated"] >= 0.90


@pytest.mark.xfail(strict=True, reason="the Leto-like model (no hot spares: a node loss waits 60 s for a node and "
                                       "30 s for its processes) gives 0.914 at 131,072 GPUs against Leto's >0.95 "
                                       "(tolerance 0.02); with an instant node it gives 0.947 (docs/goodput.md)")
def test_validation_leto_above_95_percent_at_131072_gpus():
    rep = report(with_overrides(DEFAULTS, ["num_gpus=[131072]", "strategies=[\"leto_like\"]"]))
    v = next(v for v in rep["validation"] if v["name"] == "leto_productive_time")
    assert v["pass"]


@pytest.mark.parametrize("data, message", [
    ({"failures": {"classes": [{"name": "x", "interruptions": 1, "recovery": "reboot", "detect": "crash"}]}},
     "failures.classes[0].recovery: 'reboot' is not allowed"),
    ({"failures": {"classes": [{"name": "x", "interruptions": -1, "recovery": "node", "detect": "crash"}]}},
     "failures.classes[0].interruptions=-1"),
    ({"failures": {"classes": [{"name": "x", "recovery": "node", "detect": "crash"}]}},
     "failures.classes[0]: missing required key(s) interruptions"),
    ({"job": {"iteration_s": 0}}, "job.iteration_s=0"),
    ({"hotspare": {"tier2": "raid"}}, "hotspare.tier2: 'raid' is not allowed"),
    ({"leto_like": {"m": 0}}, "leto_like.m=0"),
    ({"costs": {"rebuild_growht": "log"}}, "costs.rebuild_growht: unknown key (did you mean 'rebuild_growth'?)"),
    ({"costs": {"rebuild_growth": "cubic"}}, "costs.rebuild_growth: 'cubic' is not allowed"),
    ({"num_gpus": [1000]}, "num_gpus[0]=1000 must be a positive multiple of 128"),
    ({"strategies": ["checkpoint"]}, "strategies[0]: 'checkpoint' is not allowed"),
    ({"seeds": 1}, "seeds=1"),
    ({"target": {"num_gpus": 100}}, "target.num_gpus=100"),
    ({"gemini_like": {"every_iterations": 0}}, "gemini_like.every_iterations=0"),
])
def test_bad_config_is_rejected_naming_the_key(data, message):
    with pytest.raises(ConfigError) as info:
        from_mapping(GoodputConfig, data)
    assert message in str(info.value)


def test_overrides_are_validated_like_the_config():
    with pytest.raises(ConfigError, match="unknown key 'costs.nope'"):
        with_overrides(DEFAULTS, ["costs.nope=1"])
    with pytest.raises(ConfigError, match="costs.job_restart_s: expected a number"):
        with_overrides(DEFAULTS, ["costs.job_restart_s=slow"])
    assert with_overrides(DEFAULTS, ["costs.rebuild_growth=linear"]).costs.rebuild_growth == "linear"


def test_calibration_takes_the_measured_terms_of_a_bench_recovery_json():
    bench = {"num_ranks": 8, "keeper": {"detect_s": 0.1, "rebuild_s": 0.2, "restore_s": 0.3, "total_s": 1},
             "hotspare": {"detect_s": 0.4, "rebuild_s": 0.5, "restore_s": 0.6},
             "deepspeed_restart": {"detect_s": 1, "rebuild_s": 10, "restore_s": 0}}
    measured, notes = measured_from_bench(bench, Measured())
    assert (measured.num_ranks, measured.keeper.rebuild_s, measured.peers.restore_s) == (8, 0.2, 0.6)
    assert measured.stripe == Measured().stripe and "no 'stripe' way" in notes[0]
    model = from_mapping(GoodputConfig, {"measured": to_mapping(measured)})
    assert rebuild_s(model, 0.2, 8) == 0.2  # at the benchmark's own size the measured term is the model's
    assert rebuild_s(model, 0.2, 16) == pytest.approx(0.2 + model.costs.rebuild_per_doubling_s)
    with pytest.raises(ConfigError, match="calibration: way 'keeper' lacks rebuild_s"):
        measured_from_bench({"num_ranks": 4, "keeper": {"detect_s": 0.1, "restore_s": 0.1}}, Measured())


def test_t_quantiles_and_the_interval():
    for df, t in ((1, 12.706), (2, 4.303), (5, 2.571), (10, 2.228), (19, 2.093), (100, 1.984)):
        assert t_quantile(0.975, df) == pytest.approx(t, abs=2e-3)
    mean, low, high = mean_interval([1.0, 2.0, 3.0, 4.0], 0.95)
    assert mean == 2.5 and high - mean == pytest.approx(3.182 * statistics_stdev([1, 2, 3, 4]) / 2, abs=1e-2)


def statistics_stdev(values):
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def test_the_recipes_yaml_is_the_schemas_defaults():
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from conftest import ROOT

    ConfigStore.instance().store(name="simulate_goodput_schema", node=SimulateGoodputConfig)  # as the recipe does
    with initialize_config_dir(config_dir=f"{ROOT}/configs", version_base=None):
        cfg = compose(config_name="simulate_goodput")
    job = from_mapping(SimulateGoodputConfig, OmegaConf.to_container(cfg, resolve=True))
    for key in ("failures", "job", "measured", "costs", "checkpoint_restart", "gemini_like", "leto_like", "hotspare",
                "num_gpus", "strategies", "days", "seeds", "seed", "confidence", "validation", "target"):
        assert getattr(job, key) == getattr(DEFAULTS, key), key
    assert job.sensitivity and not job.calibration


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    rep = report(small("strategies=[\"hotspare\",\"checkpoint_restart\"]", "num_gpus=[1024,4096]", "validation=[]",
                       "target={\"strategy\": \"hotspare\", \"num_gpus\": 4096, \"at_least\": 0.97}"))
    plot(rep, str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_an_overlapped_copy_costs_the_step_only_the_capture_or_what_outlasts_the_iteration():
    """costs.copy_overlapped (the GPU capture as built): hotspare's seconds of protection per
    iteration drop by exactly the copy, unique bytes / host link, less any part longer than the
    iteration (the step waits for that); Leto-like's are unchanged."""
    cfg = small("failures.rate_scale=0")
    j = cfg.job

    def per_iter(c, strategy="hotspare"):
        p = plan(c, strategy, 1024)
        return p.overhead_fraction * p.iteration_s / (1.0 - p.overhead_fraction)

    copy = j.unique_bytes_per_param * j.model_params / 1024 / (j.host_link_gbs * 1e9)
    assert 0 < copy < j.iteration_s
    on = ["costs.copy_overlapped=true"]
    assert per_iter(cfg) - per_iter(with_overrides(cfg, on)) == pytest.approx(copy, rel=1e-9)
    slow = with_overrides(cfg, [f"job.host_link_gbs={j.host_link_gbs * copy / (2 * j.iteration_s)}"])
    # The copy now takes two iterations' time: the step waits for the second.
    assert per_iter(slow) - per_iter(with_overrides(slow, on)) == pytest.approx(j.iteration_s, rel=1e-9)
    assert per_iter(with_overrides(cfg, on), "leto_like") == per_iter(cfg, "leto_like")
