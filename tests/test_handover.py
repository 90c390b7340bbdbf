"""Slow ranks handed to spares (issue 30): a rank that becomes 3x slower is found by its compute
time, leaves at a step boundary, and a spare takes its rank with no lost iteration; the run is
bitwise identical to one with no slow rank. Real processes: 4 ranks on 2 logical nodes, gloo."""
from __future__ import annotations

import pytest

from hotspare.config import from_mapping
from hotspare.testing import job as gpt_job
from hotspare.testing import statedigest

STEPS = 30
JOB = {"train": {"steps": STEPS, "log_interval": 8}, "parallel": {"spares_per_node": 1},
       "hotspare": {"stragglers": {"enabled": True, "factor": 2.0, "window": 3}}}


def run(out_dir, **options):
    job = from_mapping(gpt_job.GPTJobConfig, JOB)
    assert gpt_job.launch(job, str(out_dir), mode="hotspare", **options) == 0
    return gpt_job.collect(str(out_dir), job.parallel.num_ranks)


@pytest.mark.slow  # about 55 s: make test is at its 20-minute budget (tests/test_stragglers.py covers the pieces)
def test_a_rank_slowed_three_times_is_handed_to_a_spare_bitwise_with_no_lost_iteration(tmp_path, no_leaks):
    ref = run(tmp_path / "ref")
    got = run(tmp_path / "slow", faults=["slow@forward:1:3:3"])
    assert all(r["recoveries"] == [] for r in ref), "a straggler was found in the run without one"
    assert got[1]["spare"] and not any(r["spare"] for i, r in enumerate(got) if i != 1)
    for rank, (a, b) in enumerate(zip(ref, got)):
        assert b["losses"] == {k: a["losses"][k] for k in b["losses"]}, f"rank {rank}: losses differ"
        assert statedigest.differences(a["state_digest"], b["state_digest"]) == [], rank
    survivors = [rec for r in got if not r["spare"] for rec in r["recoveries"]]
    assert len(survivors) == 3 and {rec["kind"] for rec in survivors} == {"handover"}
    # No lost iteration: the job lands on the step the slow rank completed before it left, the
    # survivors redo only the step they were in.
    for rec in survivors:
        assert rec["failed_at"] == rec["version"], rec
    landed = survivors[0]["version"]
    assert 3 + 3 <= landed < STEPS  # found once its window of slow steps was full
    assert got[1]["first_step"] == landed
