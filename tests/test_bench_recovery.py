"""recipes/bench_recovery.py end to end (slow: five jobs): the JSON has every key the issue
names, hotspare's run is bitwise identical to the uninterrupted one with at most one lost
iteration, and the restart baseline loses the steps since its checkpoint; the same for
``framework=megatron`` (megatron-core's dist_checkpointing restart), and bench_overhead.py's
keys on megatron."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import RECIPES

KEYS = {"detect_s", "rebuild_s", "restore_s", "recompute_s", "total_s", "lost_iterations"}


def bench(tmp_path, name: str, *overrides: str) -> dict:
    """Run recipes/bench_recovery.py with ``overrides`` in ``tmp_path``; its JSON."""
    out = tmp_path / name
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "bench_recovery.py"), f"out={out}", *overrides,
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bench_recovery_writes_its_json(tmp_path, no_leaks):
    r = bench(tmp_path, "r.json", "kill_step=14", "checkpoint_every=10", "train.steps=16")
    for way in ("hotspare", "keeper", "stripe", "deepspeed_restart", "memory_restart"):
        assert KEYS <= set(r[way]), way
        assert r[way]["total_s"] > 0
    assert r["bitwise_identical"] is True
    assert r["hotspare"]["lost_iterations"] <= 1 and r["keeper"]["lost_iterations"] <= 1
    assert r["keeper"]["network_bytes"] == 0 and r["keeper"]["sources"] == ["keeper"]
    assert r["hotspare"]["network_bytes"] > 0 and r["hotspare"]["sources"] == ["peers"]
    assert r["stripe"]["sources"] == ["stripe"] and r["stripe"]["lost_iterations"] <= 1
    assert r["deepspeed_restart"]["lost_iterations"] == 4 and r["memory_restart"]["lost_iterations"] == 0
    assert r["speedup"] > 0 and r["speedup_vs_memory_restart"] > 0


@pytest.mark.slow
def test_bench_recovery_runs_users_models_side_by_side(tmp_path, no_leaks):
    """models=[gpt,hf_gpt2]: each model's in-place ways, bitwise, with its total against the GPT's and
    the spare's engine build after its order."""
    r = bench(tmp_path, "h.json", "models=[gpt,hf_gpt2]", "ways=[hotspare,keeper]", "kill_step=6", "train.steps=8")
    assert sorted(r["models"]) == ["gpt", "hf_gpt2"] and r["bitwise_identical"] is True
    for family, m in r["models"].items():
        assert m["model"] == family and m["bitwise_identical"] is True
        for way in ("hotspare", "keeper"):
            assert KEYS <= set(m[way]) and m[way]["engine_build_s"] > 0, (family, way)
        assert set(m["total_vs_gpt"]) == {"hotspare", "keeper"}


@pytest.mark.slow
def test_bench_recovery_on_megatron_writes_the_same_keys(tmp_path, no_leaks):
    """framework=megatron: hotspare and keeper in place, megatron-core's dist_checkpointing restart
    (save every K iterations, load after the restart) and its /dev/shm variant."""
    r = bench(tmp_path, "m.json", "framework=megatron", "kill_step=14", "checkpoint_every=10", "train.steps=16")
    assert r["framework"] == "megatron" and r["pipeline_stages"] == 2
    for way in ("hotspare", "keeper", "megatron_restart", "memory_restart"):
        assert KEYS <= set(r[way]), way
    assert r["bitwise_identical"] is True
    assert r["hotspare"]["lost_iterations"] <= 1 and r["keeper"]["sources"] == ["keeper"]
    assert r["megatron_restart"]["lost_iterations"] == 4 and r["memory_restart"]["lost_iterations"] == 0
    assert r["speedup"] > 0 and r["keeper_speedup"] > 0


@pytest.mark.slow
def test_bench_overhead_on_megatron_writes_the_same_keys(tmp_path, no_leaks):
    out = tmp_path / "o.json"
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "bench_overhead.py"), f"out={out}",
                           "framework=megatron", "train.steps=40", "block=5", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["framework"] == "megatron"
    m = r["stages"]["pp2"]
    assert {"baseline_step_s", "mirror_step_s", "overhead", "mirror_bytes_per_step", "tier2_memory_ratio"} <= set(m)
    assert m["tier2_memory_ratio"]["mirror"] == pytest.approx(2.0, rel=0.05)
    assert 11 < m["unique_bytes_per_param"] < 14  # fp32 master + two Adam moments, plus the RNG and counters


@pytest.mark.slow
def test_bench_straggler_writes_its_json(tmp_path, no_leaks):
    """recipes/bench_straggler.py: the issue's keys, a handover with no lost iteration, bitwise."""
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "bench_straggler.py"), f"out={out}",
                           "train.steps=60", "slow_step=10", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert {"steps_per_s_before", "steps_per_s_slow", "steps_per_s_after", "handover_pause_s", "median_step_s",
            "detect_steps", "lost_iterations", "bitwise_identical", "steps_per_s_late", "ref_steps_per_s_late",
            "late_vs_uninterrupted"} <= set(r)
    assert r["handed_over"] and r["lost_iterations"] == 0 and r["bitwise_identical"] is True
    assert r["detect_steps"] >= 5  # at least the window (configs/bench_straggler.yaml: stragglers.window=5)
