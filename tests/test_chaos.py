"""recipes/chaos.py end to end (slow): random ranks SIGKILLed at random times from outside a run
under hotspare-run; the run must end recovered and bitwise identical to an uninterrupted one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import RECIPES


def test_the_kill_schedule_is_seeded_spaced_and_bounded():
    from hotspare.testing import matrix as chaos

    cfg = chaos.ChaosConfig(kills=4, first_after_s=5.0, min_gap_s=10.0, window_s=40.0, seed=3)
    times = chaos.schedule(cfg)
    assert times == chaos.schedule(cfg) and times != chaos.schedule(chaos.ChaosConfig(kills=4, first_after_s=5.0,
                                                                                      min_gap_s=10.0, window_s=40.0,
                                                                                      seed=4))
    assert len(times) == 4 and times[0] >= 5.0 and times[-1] <= 5.0 + 40.0
    assert all(b - a >= 10.0 for a, b in zip(times, times[1:]))
    with pytest.raises(Exception, match="window of at least"):
        chaos.ChaosConfig(kills=5, min_gap_s=20.0, window_s=40.0)


@pytest.mark.slow
def test_a_chaos_soak_ends_bitwise_identical(tmp_path, no_leaks):
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "chaos.py"), f"out={out}", "kills=2",
                           "window_s=20", "min_gap_s=12", "train.steps=700", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert out.exists(), proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["outcome"] == "recovered" and r["bitwise_identical"] is True, r
    assert len(r["kills"]) == 2 and all(k["killed"] for k in r["kills"])
    assert proc.returncode == 0
