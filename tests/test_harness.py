"""hotspare.testing.harness: a job in the background, reached as an operator reaches it (the
store's port from the launcher's socket, the plan with the job's secret, a worker's process
from the launcher's tree), never from its log."""
from __future__ import annotations

import signal
import sys
import textwrap
import time

import pytest

from hotspare import launch
from hotspare.testing.harness import Job, sweep

SCRIPT = textwrap.dedent("""
    import os, sys, time
    open(os.path.join(sys.argv[1], "up." + os.environ["HOTSPARE_WORKER_ID"]), "w").close()
    time.sleep(120)
""")


@pytest.mark.parametrize("port", ["picked", "given"])
def test_a_job_handle_finds_the_port_the_plan_and_each_worker_and_stops_everything(tmp_path, no_leaks, port):
    script = tmp_path / "sleep.py"
    script.write_text(SCRIPT)
    spec = launch.LaunchSpec(script=[str(script), str(tmp_path)], nproc_per_node=2, spares_per_node=1)
    if port == "given":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            spec.master_port = s.getsockname()[1]
    job = Job(spec, str(tmp_path / "out"))
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"up.{w}").exists() for w in ("a0", "a1", "s0.0")):
        assert time.monotonic() < deadline and job.running(), job.tail()
        time.sleep(0.05)
    assert job.port() == spec.master_port if port == "given" else job.port() > 0
    plan = job.plan(2)
    assert plan.generation == 0 and plan.workers == {"0": "a0", "1": "a1"}
    pids = {w: job.pid_of(w) for w in ("a0", "a1", "s0.0")}
    assert all(pids.values()) and len(set(pids.values())) == 3 and job.pid_of("a7") is None
    assert len(job.keeper_pids()) == 1
    assert set(sweep(job.job_id)) >= set(pids.values())
    assert job.kill("s0.0", signal.SIGKILL) and not job.kill("a7")
    job.stop()
    assert job.proc.returncode is not None and sweep(job.job_id) == []


def test_a_launcher_that_fails_at_once_is_named_with_its_log(tmp_path):
    spec = launch.LaunchSpec(script=[sys.executable], nproc_per_node=1)
    spec.script = [str(tmp_path / "missing.py")]
    job = Job(spec, str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match="launcher.log"):
        job.port(timeout_s=30)
    assert job.wait(30) not in (0, None)
