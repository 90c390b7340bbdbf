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
       "hotspare": {"stragglers": {"enabled": True, "factor": 2.0, "window": 5}}}


def run(out_dir, job=None, **options):
    job = job or from_mapping(gpt_job.GPTJobConfig, JOB)
    assert gpt_job.launch(job, str(out_dir), mode="hotspare", **options) == 0
    return gpt_job.collect(str(out_dir), job.parallel.num_ranks)


_REF: list = []


def reference(tmp_path_factory):
    if not _REF:
        _REF.extend(run(tmp_path_factory.mktemp("handover-ref")))
    return _REF


# about 55 s each: make test is at its 20-minute budget (tests/test_stragglers.py covers the pieces).
# loop=own: a DeepSpeed user's loop that does not use session.steps() (engine.step reports and hands over).
@pytest.mark.slow
@pytest.mark.parametrize("loop", ["steps", "own"])
def test_a_rank_slowed_three_times_is_handed_to_a_spare_bitwise_with_no_lost_iteration(loop, tmp_path, tmp_path_factory,
                                                                                     no_leaks):
    ref = reference(tmp_path_factory)
    mapping = {**JOB, "train": {**JOB["train"], "loop": loop}}
    got = run(tmp_path / "slow", job=from_mapping(gpt_job.GPTJobConfig, mapping), faults=["slow@forward:1:3:3"])
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
    assert 3 + 5 <= landed < STEPS  # found once its window of slow steps was full
    assert got[1]["first_step"] == landed


@pytest.mark.slow  # about 90 s (make test's budget)
def test_a_drained_rank_then_its_node_move_to_spares_elsewhere_bitwise_and_the_node_ends_its_processes(tmp_path,
                                                                                                no_leaks):
    import subprocess
    import sys
    import time

    import psutil

    from hotspare.control import auth
    from hotspare.testing.harness import Job, training_started

    job = from_mapping(gpt_job.GPTJobConfig, {"train": {"steps": 100, "log_interval": 50},
                                              "parallel": {"spares_per_node": 2}})
    ref = run(tmp_path / "ref", job=job)
    spec = gpt_job.launch_spec(job, str(tmp_path / "drain"), mode="hotspare")
    spec.job_secret_file = auth.write_secret_file(str(tmp_path / "secret"))
    handle = Job(spec, str(tmp_path / "drain"))
    try:
        deadline = time.monotonic() + 120
        while not training_started(str(tmp_path / "drain" / "events")) and time.monotonic() < deadline:
            time.sleep(0.1)
        # One rank first (--rank: a process that misbehaves), then the whole node.
        moved = subprocess.run([sys.executable, "-m", "hotspare.launch", "drain", "--master-port", str(handle.port()),
                                "--job-secret-file", spec.job_secret_file, "--rank", "3", "--wait-s", "120"],
                               capture_output=True, text=True, timeout=180)
        assert moved.returncode == 0 and "rank 3: moved to s" in moved.stderr.splitlines()[-1], moved.stderr
        drain = subprocess.run([sys.executable, "-m", "hotspare.launch", "drain", "--master-port", str(handle.port()),
                                "--job-secret-file", spec.job_secret_file, "--node", "1", "--wait-s", "120"],
                               capture_output=True, text=True, timeout=180)
        assert drain.returncode == 0, drain.stderr
        assert "node 1 is free" in drain.stderr.splitlines()[-1]
        on_node_1 = []
        for p in handle.processes():
            try:
                env = p.environ()
                if env.get("HOTSPARE_NODE_RANK") == "1" or "--node 1" in " ".join(p.cmdline()):
                    on_node_1.append((p.pid, env.get("HOTSPARE_WORKER_ID"), p.cmdline()[-3:]))
            except psutil.Error:
                continue
        assert on_node_1 == [], on_node_1
        assert handle.wait(240) == 0, handle.tail()
    finally:
        handle.stop()
    got = gpt_job.collect(str(tmp_path / "drain"), 4)
    assert [r["worker"].startswith("s0.") for r in got] == [False, False, True, True]
    for rank, (a, b) in enumerate(zip(ref, got)):
        assert b["losses"] == {k: a["losses"][k] for k in b["losses"]}, f"rank {rank}: losses differ"
        assert statedigest.differences(a["state_digest"], b["state_digest"]) == [], rank
    for r in got[:2]:
        assert {rec["kind"] for rec in r["recoveries"]} == {"handover"}
        assert all(rec["failed_at"] == rec["version"] for rec in r["recoveries"])
