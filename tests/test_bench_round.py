"""recipes/bench_round.py: real ranks (gloo, 127.0.0.1) mirror a fixed state and the JSON says
what a round cost; bad settings are refused, naming the key."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import RECIPES


def test_bench_round_writes_its_json(tmp_path, no_leaks):
    out = tmp_path / "round.json"
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "bench_round.py"), f"out={out}", "rounds=20",
                           "repeats=1", "gap_s=0.002", "snapshot_bytes=100000", "chunk_bytes=40000",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["num_ranks"] == 3 and len(r["runs"]) == 1 and len(r["runs"][0]) == 3
    for rank in r["runs"][0]:
        assert rank["rounds"] == 20
        # Measured, not thresholds: the process's CPU time holds its mirror thread's.
        assert rank["process_cpu_ms"] >= rank["mirror_thread_cpu_ms"] > 0
        # Each rank sends k+m-1 = 2 shares of ceil(bytes/k) (the snapshot is 100000 B of fp32
        # plus its layout's metadata area).
        assert rank["bytes_sent_per_round"] >= 2 * 50000
    for key in ("process_cpu_ms", "mirror_thread_cpu_ms", "capture_cpu_ms", "round_wall_ms"):
        assert r[key] > 0, key  # a number was measured (how big is the benchmark's to say)


def test_bench_round_refuses_a_bad_tier(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "bench_round.py"), "tier2=raid",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0 and "tier2: 'raid' is not allowed" in proc.stderr + proc.stdout
