"""The peers benchmark's measures (hotspare.testing.peers), on timelines written by hand, and
the benchmark itself (make slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import RECIPES
from hotspare.testing import peers


def S(slot, step, t, committed=True, participants=4, participating=True, attempt=0):
    return peers.Step(slot, step, t, committed, participants, participating, None, attempt)


def test_a_peer_that_goes_on_with_three_then_heals_the_fourth():
    """torchft's shape: the survivors throw the interrupted step away, commit two steps with 3,
    then the healed process's first step does not count its own work."""
    before = [S(s, k, 1.0 + k) for s in range(4) for k in range(5)]
    after = [S(s, 5, 12.0, committed=False) for s in (0, 2, 3)]
    after += [S(s, k, t, participants=3) for s in (0, 2, 3) for k, t in ((5, 13.0), (6, 14.0))]
    after += [S(s, 7, 16.0) for s in (0, 2, 3)] + [S(1, 7, 16.0, participating=False, attempt=1)]
    after += [S(s, 8, 17.0) for s in range(4)]
    got = peers.measure(peers.Run(before + after, 10.0, 5, 1, 4), step_time=1.0)
    assert got["survivor_downtime_s"] == 3.0 and got["time_to_full_strength_s"] == 6.0
    assert got["lost_steps_per_process"] == {"0": 1, "1": 1, "2": 1, "3": 1}
    assert got["gpu_seconds_lost"] == 3 * (6.0 - 3) + 6.0


def test_a_restart_computes_again_from_its_checkpoint_and_a_survivors_late_record_is_not_after_the_fault():
    """Killed before step 5 with a checkpoint at 3: every process does steps 3 and 4 again; a
    survivor that logged step 4 just after the victim's fault record did it before the fault."""
    before = [S(s, k, 1.0 + k) for s in range(4) for k in range(4)] + [S(0, 4, 10.2)]
    after = [S(s, k, t, attempt=1) for s in range(4) for k, t in ((3, 20.0), (4, 21.0), (5, 22.0))]
    got = peers.measure(peers.Run(before + after, 10.0, 5, 1, 4), step_time=1.0)
    assert got["survivor_downtime_s"] == 10.0 and got["time_to_full_strength_s"] == 10.0
    assert got["back_at_progress_s"] == 12.0
    # steps 3, 4 again, and each survivor's interrupted step 5
    assert got["lost_steps_per_process"] == {"0": 3, "1": 2, "2": 3, "3": 3}
    assert got["gpu_seconds_lost"] == 4 * (12.0 - 1.0)


def test_a_system_never_back_at_full_strength_has_no_gpu_seconds_figure():
    before = [S(s, k, 1.0 + k) for s in range(4) for k in range(5)]
    after = [S(s, 5, 12.0, participants=3) for s in (0, 2, 3)]
    got = peers.measure(peers.Run(before + after, 10.0, 5, 1, 4), step_time=1.0)
    assert got["time_to_full_strength_s"] is None and got["gpu_seconds_lost"] is None
    assert got["survivor_downtime_s"] == 2.0
    assert peers.max_loss_diff({5: 1.0, 6: 2.0}, {5: 1.5, 6: 2.0, 9: 3.0}, since=5) == 0.5


@pytest.mark.slow  # about 3 minutes: torchft and NVRx, each with and without the fault
def test_the_peers_run_on_this_machine_and_are_measured_from_the_fault(tmp_path, no_leaks):
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "bench_peers.py"), f"out={out}",
                           "systems=[torchft,nvrx_inprocess]", "train.steps=160", "kill_step=30",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    systems = json.loads(out.read_text())["systems"]
    for name in ("torchft", "nvrx_inprocess"):
        r = systems[name]
        assert "error" not in r, r
        assert r["survivor_downtime_s"] > 0 and r["lost_steps"] >= 1 and r["step_time_s"] > 0, r
    assert systems["nvrx_inprocess"]["standing_spare_gpus"] == 1


def test_a_hotspare_survivor_that_ended_the_step_before_the_fault_late_is_not_counted_as_back():
    """The victim dies before step 60's forward; a survivor records step 59's end just after that
    (its bookkeeping ran later). It landed on 60: its 59 is the run before the fault, not a step
    done again, and not a full-strength step after the fault (it once read as back at 0 s)."""
    sys.path.insert(0, RECIPES)
    import bench_peers

    fault = {"t": 100.0, "step": 60}
    ranks = [{"rank": r, "losses": {}, "recoveries": [{"version": 60}],
              "step_end": {"59": 100.01 if r == 2 else 99.9, "60": 100.5}} for r in range(4)]
    steps = bench_peers._landed_steps(ranks, 4, fault)
    got = peers.measure(peers.Run(steps, 100.0, 60, 1, 4), step_time=0.1)
    assert got["time_to_full_strength_s"] == pytest.approx(0.5) and got["lost_steps"] == 1
    ranks[2]["recoveries"][0]["version"] = 59  # landed a step back: its 59 done again, and the interrupted 60
    again = peers.measure(peers.Run(bench_peers._landed_steps(ranks, 4, fault), 100.0, 60, 1, 4), step_time=0.1)
    assert again["lost_steps_per_process"]["2"] == 2 and again["time_to_full_strength_s"] == pytest.approx(0.01)
