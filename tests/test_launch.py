"""hotspare-run: flags, the workers' environment, failure propagation, clean shutdown.
Starts real processes (tiny Python scripts) on 127.0.0.1; no DeepSpeed."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from hotspare import control, launch
from hotspare.control import auth

ENV_DUMP = textwrap.dedent("""
    import json, os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "HOTSPARE_NODE_RANK", "HOTSPARE_NUM_NODES", "HOTSPARE_JOB_ID", "HOTSPARE_STORE_PORT", "DS_ACCELERATOR",
            "GLOO_SOCKET_IFNAME"]
    import torch.distributed as dist, datetime
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    store.set("hello/" + os.environ["RANK"], "1")
    import psutil
    listening = sorted({c.laddr.ip for c in psutil.Process(os.getppid()).net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN})
    with open(os.path.join(sys.argv[1], "env" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump({**{k: os.environ.get(k) for k in keys}, "launcher_listens_on": listening}, f)
""")


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_parse_args_mirrors_torchrun():
    spec = launch.parse_args(["--nnodes", "2", "--nproc_per_node", "4", "--node-rank", "1",
                              "--rdzv-endpoint", "10.0.0.1:29500", "train.py", "--lr", "3"])
    assert (spec.nnodes, spec.nproc_per_node, spec.node_rank) == (2, 4, 1)
    assert (spec.master_addr, spec.master_port) == ("10.0.0.1", 29500)
    assert spec.script == ["train.py", "--lr", "3"]
    assert launch.parse_args(["-m", "pkg.mod", "x"]).script == ["-m", "pkg.mod", "x"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(nproc_per_node=0), "--nproc-per-node=0 must be at least 1"),
    (dict(nnodes=2, node_rank=2, master_port=1), "--node-rank=2 must be in [0, --nnodes=2)"),
    (dict(nproc_per_node=4, logical_nodes=3), "not divisible by --logical-nodes=3"),
    (dict(nnodes=2), "--master-port is required"),
    (dict(nnodes=2, master_port=5, logical_nodes=2, nproc_per_node=2), "use it only with --nnodes=1"),
])
def test_bad_launch_specs(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        launch.LaunchSpec(script=["x.py"], **kwargs).validate()


@pytest.mark.parametrize("argv, message", [
    (["--master-port", "-5"], "--master-port=-5 is not a port"),
    (["--master-port", "70000"], "--master-port=70000 is not a port"),
    (["--store-timeout", "0"], "--store-timeout=0.0 must be a finite number > 0"),
    (["--store-timeout", "inf"], "--store-timeout=inf must be a finite number > 0"),
    (["--node-timeout-s", "nan"], "--node-timeout-s=nan must be a finite number > 0"),
    (["--successor-wait-s", "-1"], "--successor-wait-s=-1.0 must be a finite number >= 0"),
    (["--nnodes", "2", "--master-port", "29500"], "--job-secret-file (or HOTSPARE_JOB_SECRET_FILE) is required"),
    (["--job-secret-file", "/nonexistent/secret"], "--job-secret-file /nonexistent/secret: cannot read it"),
    ([], "the training script '/nonexistent/train.py' does not exist"),
])
def test_bad_flags_stop_the_launcher_with_one_line_naming_them(argv, message, capfd):
    """hotspare-run's flags are checked before anything starts: exit code 2, one line, no trace."""
    assert launch.main([*argv, "/nonexistent/train.py"]) == 2
    err = capfd.readouterr().err
    assert f"[hotspare-run] error: {message}" in err and "Traceback" not in err, err


def test_an_address_that_does_not_resolve_is_named(monkeypatch):
    import socket

    def fail(*_args, **_kwargs):  # (no lookup leaves this machine)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    with pytest.raises(ValueError, match="--master-addr='node0.example' does not resolve"):
        launch.LaunchSpec(script=["x.py"], master_addr="node0.example").validate()


def test_a_stale_extension_build_lock_is_named_and_where_torch_builds(tmp_path, capfd, monkeypatch):
    """A build killed midway leaves torch's lock file: any later worker needing that op would
    wait for it forever. A lock nobody holds that the launcher cannot be sure of (here: on a
    network file system, where another machine may hold it) is named at once, with what to do."""
    from torch.utils import cpp_extension

    import hotspare.launch.buildlocks

    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "lock").touch()
    monkeypatch.setattr(hotspare.launch.buildlocks, "file_system_of", lambda p: ("/home", "nfs"))
    assert launch.clear_stale_build_locks(str(tmp_path)) == [str(tmp_path / "fused_adam" / "lock")]
    assert f"rm {tmp_path / 'fused_adam' / 'lock'}" in capfd.readouterr().err
    assert (tmp_path / "fused_adam" / "lock").exists()  # not removed: it may be another machine's
    # Where torch 2.13 builds (it creates the directory; hotspare computes the same path without).
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    probe = cpp_extension._get_build_directory("hotspare-probe", verbose=False)
    try:
        assert os.path.dirname(probe) == launch.extensions_root(os.environ)
    finally:
        os.rmdir(probe)
    assert launch.extensions_root({"TORCH_EXTENSIONS_DIR": "/x"}) == "/x"


def test_workers_get_ranks_nodes_and_the_store(tmp_path, no_leaks):
    script = write(tmp_path, "dump.py", ENV_DUMP)
    code = launch.run(launch.LaunchSpec(script=[script, str(tmp_path)], nproc_per_node=4, logical_nodes=2,
                                        job_id="jobx"))
    assert code == 0
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(4)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["HOTSPARE_NODE_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["HOTSPARE_NUM_NODES"] for e in envs} == {"2"}
    assert {e["HOTSPARE_JOB_ID"] for e in envs} == {"jobx"}
    # The launcher picked a free port and every worker reached its store there.
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and envs[0]["MASTER_PORT"] != "0"
    assert {e["DS_ACCELERATOR"] for e in envs} == {os.environ.get("DS_ACCELERATOR", "cpu")}
    # Control-plane safety: the store listens on the launcher's address only, and the workers'
    # collectives are told to use its interface (loopback on one machine).
    assert envs[0]["launcher_listens_on"] == ["127.0.0.1"]
    assert {e["GLOO_SOCKET_IFNAME"] for e in envs} == {os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


def test_a_failing_worker_stops_the_job_with_its_code(tmp_path, no_leaks):
    script = write(tmp_path, "fail.py", textwrap.dedent("""
        import os, sys, time
        if os.environ["RANK"] == "2":
            sys.exit(3)
        time.sleep(3600)  # until the launcher stops it (a launcher that does not: the test's timeout)
    """))
    assert launch.run(launch.LaunchSpec(script=[script], nproc_per_node=3, term_grace_s=5)) == 3


def test_a_killed_worker_is_reported_as_a_signal(tmp_path, no_leaks):
    script = write(tmp_path, "kill.py", textwrap.dedent("""
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """))
    assert launch.run(launch.LaunchSpec(script=[script], nproc_per_node=2, term_grace_s=5)) == 128 + signal.SIGKILL


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path, no_leaks):
    script = write(tmp_path, "sleep.py", textwrap.dedent("""
        import os, subprocess, sys, time
        # A grandchild too: the launcher must stop the worker's whole session.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open(os.path.join(sys.argv[1], "up" + os.environ["RANK"]), "w").close()
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, "-m", "hotspare.launch", "--nproc-per-node", "2", script,
                             str(tmp_path)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"up{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "workers never started"
        time.sleep(0.05)
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert len(descendants) == 5  # 2 workers, their 2 children, the node's keeper
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM, stopping workers" in err
    gone, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, f"left running: {[p.pid for p in alive]}"


def test_nothing_outlives_a_killed_launcher(tmp_path, no_leaks):
    """hotspare-run is SIGKILLed (no handler runs) while its ranks train and a spare waits: the
    kernel kills every worker with it, and its keeper removes its segments and exits. Once the
    launcher is gone, its workers are not left training alone."""
    script = write(tmp_path, "sleep.py", textwrap.dedent("""
        import os, sys, time
        open(os.path.join(sys.argv[1], "up." + os.environ["HOTSPARE_WORKER_ID"]), "w").close()
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, "-m", "hotspare.launch", "--nproc-per-node", "2", "--spares-per-node",
                             "1", script, str(tmp_path)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"up.{w}").exists() for w in ("a0", "a1", "s0.0")):
        assert time.monotonic() < deadline, "workers never started"
        time.sleep(0.05)
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert len(descendants) == 4  # 2 ranks, a spare, the node's keeper
    proc.kill()
    proc.wait(timeout=10)
    gone, alive = psutil.wait_procs(descendants, timeout=15)
    assert not alive, f"left running after their launcher died: {[p.cmdline() for p in alive]}"


SPARE_SCRIPT = textwrap.dedent("""
    import glob, json, os, sys, time
    from hotspare import control, worker
    from hotspare.generation import store_from_env
    out = sys.argv[1]
    store = control.ControlStore(store_from_env())
    wid = worker.worker_id()

    def wait_for(*patterns):  # files in out; bounded: the test's assertions say what did not happen
        deadline = time.monotonic() + 60
        while not all(glob.glob(os.path.join(out, p)) for p in patterns if p) and time.monotonic() < deadline:
            time.sleep(0.02)

    if worker.role() == "spare":
        open(os.path.join(out, "started." + wid), "w").close()
        deadline = time.monotonic() + 60
        while os.environ.get("SPARES_AFTER_FAILURE") and not store.failures(0)[0] and time.monotonic() < deadline:
            time.sleep(0.02)  # not ready before the failure: the coordinator must wait for a spare
        try:
            plan = worker.wait_for_order(store, wid)
        except worker.Shutdown:
            open(os.path.join(out, "shutdown." + wid), "w").close()
            sys.exit(0)
        rank = plan.rank_of(wid)
        with open(os.path.join(out, "took." + wid), "w") as f:
            json.dump({"rank": rank, "generation": plan.generation, "failures": plan.failures}, f)
        if "CAUGHT_UP_AFTER" in os.environ:  # what rank 0 of a recovered generation says once caught up
            wait_for(os.environ["CAUGHT_UP_AFTER"])
            store.set_caught_up(plan.generation, 1)
        wait_for(os.environ.get("TAKEN_UNTIL"))  # then it ends as its rank would
    else:
        rank = int(os.environ["RANK"])
        store.mark_trained()  # as rank 0 of a job past its first step
        hb = worker.Heartbeat(wid, 0.1, float(os.environ.get("HB_TIMEOUT", "2")))
        mode = os.environ.get("FAIL_" + wid, "")
        if mode == "exit":
            os._exit(7)
        if mode == "exit_after_takeover":
            # A second failure, once an earlier one was taken over and the launcher held the
            # promoted spare's successor back (passed.<wid>: see SuccessorSpy).
            wait_for("took.*", "passed.*")
            os._exit(7)
        if mode == "hang":  # once every spare is ready: node 0's takes the rank
            deadline = time.monotonic() + 60
            while not all(store.is_ready(s) for s in os.environ["SPARES"].split(",")) and time.monotonic() < deadline:
                time.sleep(0.02)
            import signal
            os.kill(os.getpid(), signal.SIGSTOP)  # beat 0 is in the store: the launcher watches it
        wait_for(os.environ.get("RUN_UNTIL"))
        hb.close()
        open(os.path.join(out, "done." + wid), "w").close()
""")


class SuccessorSpy:
    """Watches the launcher's successor policy (launch.run runs it in this process): ``started``
    holds, for each successor it started, what the control store said right after (the
    generations caught up, the workers whose failures were reported); and after each pass of
    the policy that looked at a successor ``wid`` it touches ``out/passed.<wid>``. A worker that waits for that file
    before it acts acts after a pass that could have started ``wid`` too early, and after that
    pass's read: keys are only ever added, so ``started`` shows whether what was due had
    happened when ``wid`` was started."""

    def __init__(self, monkeypatch, out):
        from hotspare.launch.successors import Successors

        self.out, self.started = out, {}
        start_due = Successors.start_due

        def spy(successors, generation):
            pending = [s.wid for s in successors.pending]
            start_due(successors, generation)
            if not pending:
                return
            plane = successors.control()
            for wid in set(pending) - {s.wid for s in successors.pending}:
                self.started[wid] = {"caught_up": [g for g in range(1, generation + 1) if plane.caught_up(g)],
                                     "failed": sorted(f.worker for f in plane.failures(0)[0])}
            for wid in pending:
                (self.out / f"passed.{wid}").touch()

        monkeypatch.setattr(Successors, "start_due", spy)


def test_a_spare_takes_a_dead_ranks_place_and_a_new_spare_starts_once_caught_up(tmp_path, no_leaks, capfd,
                                                                                 monkeypatch):
    script = write(tmp_path, "spare.py", SPARE_SCRIPT)
    spy = SuccessorSpy(monkeypatch, tmp_path)
    spec = launch.LaunchSpec(script=[script, str(tmp_path)], nproc_per_node=4, logical_nodes=2, spares_per_node=1,
                             extra_env={"FAIL_a3": "exit", "SPARES_AFTER_FAILURE": "1",
                                        "CAUGHT_UP_AFTER": "passed.s*.1", "RUN_UNTIL": "started.s*.1"},
                             term_grace_s=30)
    assert launch.run(spec) == 0
    # Rank 3 (logical node 1) dies before any spare is ready (they wait for its failure report):
    # the first ready spare takes it in generation 1 (node 1's if both are ready by then).
    [path] = tmp_path.glob("took.*")
    promoted = path.name[len("took."):]
    took = json.loads(path.read_text())
    assert took["rank"] == 3 and took["generation"] == 1
    assert took["failures"][0]["worker"] == "a3" and took["failures"][0]["code"] == 7
    assert {p.name for p in tmp_path.glob("done.*")} == {"done.a0", "done.a1", "done.a2"}
    # The promoted spare's node got a new spare, started only once generation 1 said it caught
    # up (not with the plan: its warm-up would compete with the recovery; the promoted spare
    # says so only after the launcher held the successor back once); it and the other node's
    # spare were released at the end.
    node = int(promoted[1:promoted.index(".")])
    successor, other = f"s{node}.1", f"s{1 - node}.0"
    assert spy.started == {successor: {"caught_up": [1], "failed": ["a3"]}}, spy.started
    assert f"starting spare {successor} on node {node} (the generation caught up)" in capfd.readouterr().err
    assert {p.name for p in tmp_path.glob("shutdown.*")} == {f"shutdown.{other}", f"shutdown.{successor}"}


def test_a_successor_starts_after_its_wait_runs_out_or_at_once_when_another_failure_comes(tmp_path, no_leaks, capfd,
                                                                                          monkeypatch):
    """Nobody says the generation caught up. One node, one spare: rank 1 dies, s0.0 takes it;
    its successor s0.1 is registered but not started. Rank 0 dies after that takeover: s0.1 starts at
    once (its wait, 30 s, has not run out) and takes rank 0. Then a job whose wait is 1 s (how
    long it waits: test_a_successor_is_due_when_caught_up_another_failure_came_or_its_wait_ran_out)."""
    script = write(tmp_path, "spare.py", SPARE_SCRIPT)
    spy = SuccessorSpy(monkeypatch, tmp_path)
    spec = launch.LaunchSpec(script=[script, str(tmp_path)], nproc_per_node=2, logical_nodes=1, spares_per_node=1,
                             extra_env={"FAIL_a1": "exit", "FAIL_a0": "exit_after_takeover",
                                        "TAKEN_UNTIL": "took.s0.1"}, term_grace_s=30)
    assert launch.run(spec) == 0
    assert json.loads((tmp_path / "took.s0.0").read_text())["rank"] == 1
    second = json.loads((tmp_path / "took.s0.1").read_text())
    assert second["rank"] == 0 and second["generation"] == 2 and second["failures"][0]["worker"] == "a0"
    assert spy.started == {"s0.1": {"caught_up": [], "failed": ["a0", "a1"]}}, spy.started  # a0's came first
    assert "starting spare s0.1 on node 0 (another failure came)" in capfd.readouterr().err

    out = spy.out = tmp_path / "bound"
    out.mkdir()
    spy.started.clear()
    spec = launch.LaunchSpec(script=[script, str(out)], nproc_per_node=2, logical_nodes=1, spares_per_node=1,
                             successor_wait_s=1.0, extra_env={"FAIL_a1": "exit", "RUN_UNTIL": "started.s0.1"},
                             term_grace_s=30)
    assert launch.run(spec) == 0
    assert json.loads((out / "took.s0.0").read_text())["rank"] == 1
    assert spy.started == {"s0.1": {"caught_up": [], "failed": ["a1"]}}, spy.started  # nothing else was due
    assert "starting spare s0.1 on node 0 (--successor-wait-s=1.0 ran out)" in capfd.readouterr().err
    assert (out / "shutdown.s0.1").exists()


def test_a_successor_is_due_when_caught_up_another_failure_came_or_its_wait_ran_out(monkeypatch, capfd):
    """The successor policy on its own clock, driven here (in process, a real control store, no
    workers): a successor registered at t=100 with --successor-wait-s=1 is not started at 100.999
    and is at 101; one is started at once when its generation (or a later one) caught up, or
    when a failure its plan does not answer is reported."""
    from hotspare.launch import successors

    now = [100.0]
    launcher = launch.Launcher(launch.LaunchSpec(script=["unused"], nproc_per_node=2))
    launcher.open_store()
    plane = launcher.control
    failure = control.Failure(worker="a1", rank=1, code=-9, reason="exit", wall_time=time.time())
    plane.report_failure(failure)
    started = []
    policy = successors.Successors(1.0, lambda: plane, lambda wid, node: started.append(wid), clock=lambda: now[0])

    def register(wid, g):
        policy.register(wid, 0, control.Plan(g, 2, {"0": "a0", "1": "s0.0"}, replaced={"1": "s0.0"},
                                             failures=[dataclasses.asdict(failure)], failures_read=1))

    register("s0.1", 1)
    for t in (100.0, 100.999):
        now[0] = t
        policy.start_due(1)
        assert started == [], t
    now[0] = 101.0
    policy.start_due(1)
    assert started == ["s0.1"] and "starting spare s0.1 on node 0 (--successor-wait-s=1.0 ran out)" in \
        capfd.readouterr().err
    register("s0.2", 2)
    policy.start_due(2)
    plane.set_caught_up(3, 1)  # a later generation than the successor's caught up
    policy.start_due(3)
    assert started == ["s0.1", "s0.2"] and "s0.2 on node 0 (the generation caught up)" in capfd.readouterr().err
    register("s0.3", 4)
    policy.start_due(4)
    plane.report_failure(control.Failure(worker="a0", rank=0, code=-9, reason="exit", wall_time=time.time()))
    policy.start_due(4)
    assert started == ["s0.1", "s0.2", "s0.3"] and "s0.3 on node 0 (another failure came)" in capfd.readouterr().err


def test_a_silent_worker_is_killed_and_replaced(tmp_path, no_leaks):
    script = write(tmp_path, "spare.py", SPARE_SCRIPT)
    spec = launch.LaunchSpec(script=[script, str(tmp_path)], nproc_per_node=2, logical_nodes=2, spares_per_node=1,
                             extra_env={"FAIL_a0": "hang", "SPARES": "s0.0,s1.0", "HB_TIMEOUT": "1",
                                        "RUN_UNTIL": "took.*"}, term_grace_s=5)
    assert launch.run(spec) == 0
    took = json.loads((tmp_path / "took.s0.0").read_text())
    failure = took["failures"][0]
    # Found by its silence (not by an exit, which it never made); how long the launcher waits:
    # test_a_worker_is_silent_once_it_beat_and_then_did_not_for_its_timeout.
    assert took["rank"] == 0 and failure["reason"] == "heartbeat" and failure["code"] == -signal.SIGKILL


def test_a_worker_is_silent_once_it_beat_and_then_did_not_for_its_timeout():
    """The launcher's heartbeat rule on its own clock, driven here: a worker is watched from its
    first beat, with the timeout it asked for then; silent for exactly that long it is not
    reported, a little longer it is (with how long), a new beat starts over, a goodbye ends it."""
    from types import SimpleNamespace

    w = launch.Worker("a0", 0, SimpleNamespace(pid=os.getpid()), rank=0)
    try:
        assert w.heard(None, None, 10.0) is None and w.heard(None, None, 99.0) is None  # no beat yet
        assert w.heard(0, 1.0, 100.0) is None  # the first beat, asking for 1 s
        assert w.heard(0, None, 101.0) is None
        assert w.heard(0, None, 101.25) == 1.25
        assert w.heard(1, None, 101.5) is None and w.heard(1, None, 102.5) is None
        assert w.heard(1, None, 102.75) == 1.25
        assert w.heard(-1, None, 103.0) is None and w.heard(-1, None, 200.0) is None  # goodbye
    finally:
        w.finish()


def test_without_a_ready_spare_the_job_stops_with_the_code(tmp_path, no_leaks):
    script = write(tmp_path, "spare.py", SPARE_SCRIPT)
    spec = launch.LaunchSpec(script=[script, str(tmp_path)], nproc_per_node=2, logical_nodes=2,
                             extra_env={"FAIL_a1": "exit", "RUN_UNTIL": "never"}, term_grace_s=5)
    # The survivor would wait for a file nobody writes (60 s); the abort stops it (the pytest
    # timeout bounds a hang).
    assert launch.run(spec) == 7


def test_the_coordinator_plans_once_every_worker_is_accounted_for_not_before():
    """In process, no workers: rank 1's failure is reported, a spare is ready, and the settle
    window is long. The plan waits while rank 3 has not said it left generation 0, and is
    written at once when it has (every worker failed or left: nothing else can be coming)."""

    from hotspare.coordinator import Coordinator

    launcher = launch.Launcher(launch.LaunchSpec(script=["unused"], nproc_per_node=4, logical_nodes=2,
                                                 settle_s=30.0))
    launcher.open_store()
    coordinator = Coordinator(launcher.spec, launcher.control, launcher.world_size, launcher.port)
    plane = launcher.control
    plane.register_spare("s0.0", 0)
    plane.set_ready("s0.0", control.SPARE_ANY)
    plane.report_failure(control.Failure(worker="a1", rank=1, code=-9, reason="exit", wall_time=time.time()))
    for wid, rank in (("a0", 0), ("a2", 2)):
        plane.report_waiting(control.Waiting(worker=wid, rank=rank, generation=0))
    coordinator.step()
    assert not plane.has_plan(1)  # rank 3 may still be failing: settle
    assert plane.prepare_for("s0.0").rank == 1  # the spare builds rank 1's engine meanwhile
    plane.report_waiting(control.Waiting(worker="a3", rank=3, generation=0))
    coordinator.step()
    assert plane.plan(1).replaced == {"1": "s0.0"} and plane.order_for("s0.0") == 1


def test_the_coordinator_alarms_every_worker_of_a_generation_once_it_learns_that_it_failed():
    """The first failure report of generation 0 sets alarm/0/<wid> for each of its workers (they
    leave at once, see Heartbeat), before any plan; a spare's failure alarms nobody."""
    from hotspare.coordinator import Coordinator

    launcher = launch.Launcher(launch.LaunchSpec(script=["unused"], nproc_per_node=4, logical_nodes=2,
                                                 settle_s=30.0))
    launcher.open_store()
    store = launcher.store
    coordinator = Coordinator(launcher.spec, launcher.control, launcher.world_size, launcher.port)
    plane = launcher.control
    keys = [control.keys.alarm(0, f"a{r}") for r in range(4)]
    plane.report_failure(control.Failure(worker="s1.0", rank=-1, code=-9, reason="exit", wall_time=time.time()))
    coordinator.step()
    assert not any(store.check([k]) for k in keys)
    plane.report_failure(control.Failure(worker="a1", rank=1, code=-9, reason="exit", wall_time=time.time()))
    coordinator.step()
    assert all(store.check([k]) for k in keys) and not plane.has_plan(1)


def test_a_member_still_in_a_failed_generation_after_the_grace_is_killed_as_stuck():
    """In process, no workers: generation 0 formed (every rank arrived), rank 1 died, ranks 0 and 2
    said they left it (their rendezvous gives up after 1 s), rank 3 said nothing (a wait its
    broken sockets did not end). Not before four fifths of that rendezvous (a wait that ends at
    its own timeout keeps the member), then the coordinator asks for rank 3's kill, once, and for
    nobody else's. A generation that never formed (a member died in its rendezvous) kills
    nobody: its members wait in the rendezvous, which the next plan ends."""
    from hotspare.coordinator import Coordinator

    launcher = launch.Launcher(launch.LaunchSpec(script=["unused"], nproc_per_node=4, logical_nodes=2,
                                                 spares_per_node=1, stall_grace_s=0.2))
    launcher.open_store()
    store = launcher.store
    now = [100.0]  # the coordinator's clock, driven here: no sleeps, no timing of this machine
    coordinator = Coordinator(launcher.spec, launcher.control, launcher.world_size, launcher.port, clock=lambda: now[0])
    plane = launcher.control
    for r in range(4):
        store.set(control.keys.arrived(0, r), "1")
    for wid, node in (("s0.0", 0), ("s1.0", 1)):
        plane.register_spare(wid, node)
        plane.set_ready(wid, control.SPARE_ANY)

    def fail(wid, rank):
        plane.report_failure(control.Failure(worker=wid, rank=rank, code=-9, reason="exit", wall_time=time.time()))

    def kills():
        return [k.worker for k in plane.kills(0)[0]]

    fail("a1", 1)
    for wid, rank in (("a0", 0), ("a2", 2)):
        plane.report_waiting(control.Waiting(worker=wid, rank=rank, generation=0, rendezvous_timeout_s=1.0))
    coordinator.step()  # the alarm, at 100.0
    now[0] += 0.1  # the settle window
    coordinator.step()
    assert plane.plan(1).replaced == {"1": "s0.0"}
    fail("s0.0", 1)  # generation 1 fails while it forms: only ranks 0 and 2 arrived
    store.set(control.keys.arrived(1, 0), "1")
    store.set(control.keys.arrived(1, 2), "1")
    for t in (100.4, 100.79):  # past the grace, not yet four fifths of the others' rendezvous
        now[0] = t
        coordinator.step()
        assert kills() == [], t
    now[0] = 100.81
    for _ in range(3):
        coordinator.step()
    assert kills() == ["a3"]


def test_a_failing_exit_is_read_from_proc_before_the_process_is_reaped(tmp_path):
    """exiting_status: nothing while a worker runs; once its exit began (here: it is a zombie,
    not reaped), the status its returncode will have: -9 for SIGKILL, 3 for exit(3), and None
    for exit(0) (not a failure)."""
    import select

    for code, want in (("os.kill(os.getpid(), 9)", -9), ("os._exit(3)", 3), ("os._exit(0)", None)):
        proc = subprocess.Popen([sys.executable, "-c", f"import os, sys; sys.stdin.read(1); {code}"],
                                stdin=subprocess.PIPE)
        w = launch.Worker("a0", 0, proc, rank=0)
        try:
            assert w.stat_fd >= 0 and w.exiting() is None
            proc.stdin.write(b"x")
            proc.stdin.flush()
            assert select.select([w.pidfd], [], [], 30)[0]  # exited, still unreaped
            assert w.exiting() == want
        finally:
            proc.wait(timeout=30)
            w.finish()
        assert proc.returncode == (want or 0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_with_spare_wait_the_job_waits_for_a_replacement_node_that_brings_spares(tmp_path, no_leaks):
    """More failures than spares, configured to wait: the coordinator waits (saying how to bring
    spares) until a launcher started later with --spares-only registers one, which takes the rank."""
    script = write(tmp_path, "spare.py", SPARE_SCRIPT)
    port = _free_port()
    secret = auth.write_secret_file(str(tmp_path / "job.secret"))
    env = {**os.environ, "FAIL_a1": "exit", "RUN_UNTIL": "took.s1.0", "HOTSPARE_JOB_SECRET_FILE": secret}
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen([sys.executable, "-m", "hotspare.launch", "--nproc-per-node", "2", "--master-port",
                                str(port), "--spare-wait-s", "60", "--job-id", "waitjob", script, str(tmp_path)],
                               env=env, stderr=out, text=True)
    try:
        deadline = time.monotonic() + 60
        while "waiting up to" not in log.read_text():  # rank 1 failed and nothing can replace it
            assert job.poll() is None, "the job stopped instead of waiting for a spare: " + log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        joiner = subprocess.run([sys.executable, "-m", "hotspare.launch", "--spares-only", "--node-rank", "1",
                                 "--spares-per-node", "1", "--master-port", str(port), "--job-id", "waitjob", script,
                                 str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
        job.wait(timeout=120)
    finally:
        job.kill()
        job.wait()
    err = log.read_text()
    assert job.returncode == 0 and joiner.returncode == 0, err[-2000:] + joiner.stderr[-2000:]
    assert "waiting up to 60 s for more" in err and "--spares-only" in err
    took = json.loads((tmp_path / "took.s1.0").read_text())
    assert took["rank"] == 1 and took["failures"][0]["worker"] == "a1"
    assert (tmp_path / "done.a0").exists()


def test_a_stranger_on_the_store_port_cannot_act_on_the_job(tmp_path, no_leaks):
    """A plain TCPStore client writes what the job acts on, unsigned: shutdown (once made the
    spares exit and the launcher report success for an unfinished run), a failure report for a
    live rank, a kill request, an abort, a plan; and a second hotspare-run with another secret
    tries to join as node 1. Nothing is carried out: each forged key is named once, the
    intruding launcher is refused (exit 2), and the job trains to its end (exit 0) with its
    spare, which sees the real shutdown at the end."""
    import torch.distributed as dist

    script = write(tmp_path, "spare.py", SPARE_SCRIPT)
    port = _free_port()
    log = tmp_path / "job.log"
    env = {**os.environ, "RUN_UNTIL": "go"}
    with open(log, "w") as out:
        job = subprocess.Popen([sys.executable, "-m", "hotspare.launch", "--nproc-per-node", "2", "--spares-per-node",
                                "1", "--master-port", str(port), script, str(tmp_path)], env=env, stderr=out)
    try:
        stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        deadline = time.monotonic() + 60
        while not (stranger.check([control.keys.heartbeat("a0"), control.keys.heartbeat("a1")])
                   and (tmp_path / "started.s0.0").exists()):
            assert time.monotonic() < deadline and job.poll() is None, log.read_text()
            time.sleep(0.05)
        stranger.set(control.keys.SHUTDOWN, "1")
        stranger.set(f"{control.keys.FAIL}{stranger.add(control.keys.FAIL_COUNT, 1) - 1}", control.messages.to_json(
            control.Failure(worker="a1", rank=1, code=-9, reason="exit", wall_time=time.time())))
        stranger.set(f"{control.keys.KILL}{stranger.add(control.keys.KILL_COUNT, 1) - 1}",
                     control.messages.to_json(control.Kill(worker="a0")))
        stranger.set(control.keys.ABORT, "forged")
        stranger.set(control.keys.plan(1), control.Plan(1, 2, {"0": "a0", "1": "s0.0"}, replaced={"1": "s0.0"}).to_json())
        forged = ["'shutdown'", "'fail/0'", "'kill/0'", "'abort'", "'plan/1'"]
        while not all(f"control store key {k}: not signed" in log.read_text() for k in forged):
            assert time.monotonic() < deadline and job.poll() is None, log.read_text()
            time.sleep(0.05)
        other = auth.write_secret_file(str(tmp_path / "other.secret"))
        intruder = subprocess.run([sys.executable, "-m", "hotspare.launch", "--nnodes", "2", "--node-rank", "1",
                                   "--master-port", str(port), "--job-secret-file", other, script, str(tmp_path)],
                                  capture_output=True, text=True, timeout=60)
        assert intruder.returncode == 2 and "not signed with this process's job secret" in intruder.stderr, \
            intruder.stderr
        (tmp_path / "go").touch()
        assert job.wait(timeout=60) == 0, log.read_text()
    finally:
        job.kill()
        job.wait()
    text = log.read_text()
    assert "failed:" not in text and "stuck" not in text and "stopped the job" not in text, text
    assert (tmp_path / "shutdown.s0.0").exists() and not list(tmp_path.glob("took.*"))
    assert all((tmp_path / f"done.a{r}").exists() for r in range(2))


def test_a_signed_value_of_the_wrong_shape_stops_the_job_naming_its_key(tmp_path, no_leaks):
    """A value signed with the job's secret that is not what its key holds (only a bug can write
    one) stops the job with that key named and exit code BAD_CONTROL_EXIT_CODE, no traceback."""
    import torch.distributed as dist

    script = write(tmp_path, "spare.py", SPARE_SCRIPT)
    port = _free_port()
    secret = auth.write_secret_file(str(tmp_path / "job.secret"))
    log = tmp_path / "job.log"
    env = {**os.environ, "RUN_UNTIL": "never"}
    with open(log, "w") as out:
        job = subprocess.Popen([sys.executable, "-m", "hotspare.launch", "--nproc-per-node", "2", "--master-port",
                                str(port), "--job-id", "badjob", "--job-secret-file", secret, script,
                                str(tmp_path)], env=env, stderr=out)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        plane = control.ControlStore(store, auth.Signer(auth.read_secret_file(secret), "badjob"))
        deadline = time.monotonic() + 60
        while plane.beats("a0") is None or plane.beats("a1") is None:
            assert time.monotonic() < deadline and job.poll() is None, log.read_text()
            time.sleep(0.05)
        plane.put(control.keys.plan(1), '{"generation": 1}')
        assert job.wait(timeout=60) == launch.BAD_CONTROL_EXIT_CODE, log.read_text()
    finally:
        job.kill()
        job.wait()
    text = log.read_text()
    assert "error: control store key 'plan/1': missing field(s)" in text and "Traceback" not in text, text


def test_spares_only_needs_a_new_node_index_and_the_jobs_store():
    with pytest.raises(ValueError, match="--spares-only joins a running job as a new node"):
        launch.LaunchSpec(script=["x.py"], spares_only=True, spares_per_node=1, master_port=5).validate()
    launch.LaunchSpec(script=["x.py"], spares_only=True, node_rank=1, spares_per_node=1, master_port=5,
                      job_secret_file="job.secret").validate()


def signed_plane(master, monkeypatch) -> control.ControlStore:
    """A worker's environment for a store on ``master``'s port with a fresh job secret, and the
    job's signed view of the store (what the coordinator writes with)."""
    from hotspare import env
    from hotspare.control import auth

    secret = auth.new_secret()
    monkeypatch.setenv(env.HOTSPARE_STORE_HOST, "127.0.0.1")
    monkeypatch.setenv(env.HOTSPARE_STORE_PORT, str(master.port))
    monkeypatch.setenv(env.HOTSPARE_JOB_SECRET, secret.hex())
    monkeypatch.delenv(env.HOTSPARE_JOB_ID, raising=False)
    return control.ControlStore(master, auth.Signer(secret, ""))


def until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Return once ``condition()`` holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.01)


def test_a_workers_alarm_thread_calls_back_for_its_generation_only_and_ends_at_close(monkeypatch, capfd):
    """Heartbeat's alarm thread blocks on alarm/<g>/<wid> for the generation watched: the alarm
    of that generation calls back (once), one that comes while the worker recovers (watching
    None) does not, nor a stranger's unsigned one, the next generation's does; close() ends the
    thread though no alarm came. Each "does not" is read once the thread is past the point
    where it would have called back (what it listens on, what it logged)."""
    import threading

    import torch.distributed as dist

    from hotspare.worker import Heartbeat

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    plane = signed_plane(master, monkeypatch)
    fired = []
    event = threading.Event()

    def callback():
        fired.append(time.monotonic())
        event.set()

    hb = Heartbeat("a1", 60.0, 600.0)
    try:
        hb.watch(0, callback)
        plane.alarm(0, ["a1"])
        assert event.wait(10) and len(fired) == 1
        hb.watch(None)  # recovering: generation 1's alarm (a failure while it forms) is not for it
        event.clear()
        plane.alarm(1, ["a1"])
        hb.watch(2, callback)
        until(lambda: hb.listening == 2, "the alarm thread waiting on generation 2's key")
        assert len(fired) == 1  # it went from generation 0's alarm to 2's without calling back for 1
        master.set(control.keys.alarm(2, "a1"), "1")  # a stranger's alarm: unsigned, ignored
        err = []
        until(lambda: err.append(capfd.readouterr().err) or "'alarm/2/a1': not signed" in "".join(err),
              "the alarm thread naming the unsigned alarm")
        assert len(fired) == 1 and not event.is_set()  # it read the forgery and waits on
        plane.alarm(2, ["a1"])
        assert event.wait(10) and len(fired) == 2
        hb.watch(3, callback)
        until(lambda: hb.listening == 3, "the alarm thread waiting on generation 3's key")  # close must end that wait
    finally:
        hb.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("hotspare-")]
    assert master.check([control.keys.alarm(3, "a1")]) and len(fired) == 2


def test_a_beat_looks_for_the_next_plan_only_without_the_alarm_thread(monkeypatch):
    """Each beat is one store write: with the alarm thread (the coordinator alarms every worker
    before it writes a plan) the beat does not also look for plan/<g+1>; with a store passed in
    (no alarm thread) it does, and fires. "Does not" is read after two beats written once the
    plan was there: the first of them looked, if beats look, before the second was written."""
    import threading

    import torch.distributed as dist

    from hotspare.worker import Heartbeat

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    plane = signed_plane(master, monkeypatch)
    for alarm_thread in (True, False):
        event = threading.Event()
        store = None if alarm_thread else dist.TCPStore("127.0.0.1", master.port, is_master=False)
        hb = Heartbeat("a1", 0.02, 600.0, store=store)
        try:
            hb.watch(0, event.set)
            plane.write_plan(control.Plan(1, 2, {"0": "a0", "1": "a1"}))
            if alarm_thread:
                beat = plane.beats("a1")
                until(lambda: plane.beats("a1") >= beat + 2, "two more beats")
                assert not event.is_set()
            else:
                assert event.wait(10)
        finally:
            hb.close()
            master.delete_key(control.keys.plan(1))


def test_a_worker_about_to_be_killed_as_stuck_writes_where_it_is_stuck():
    """A worker under hotspare-run dumps every thread's stack on control.STACKS_SIGNAL, even with
    its main thread blocked outside Python, so that the kill's log line is followed by where."""
    import select


    code = ("import sys, threading; from hotspare.worker import enable_stack_dumps; enable_stack_dumps()\n"
            "def blocked_right_here(): threading.Event().wait()\n"
            "print('ready', flush=True); blocked_right_here()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert select.select([proc.stdout], [], [], 60)[0] and proc.stdout.readline() == b"ready\n"
        launch.dump_stacks(proc)
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert b"blocked_right_here" in err and b"<string>" in err, err.decode(errors="replace")


def _coordinator_with_spares(count: int, trained: bool = True, **spec):
    """In process, no workers: a coordinator for 4 ranks on 2 nodes, ``count`` ready spares on
    node 0, and ``fail_and_plan(wid, rank, g)``: report that failure, step until plan g is written.
    ``trained``: the job's first step completed (control.TRAINED)."""
    from hotspare.coordinator import Coordinator

    launcher = launch.Launcher(launch.LaunchSpec(script=["unused"], nproc_per_node=4, logical_nodes=2,
                                                 spares_per_node=4, settle_s=0.0, **spec))
    launcher.open_store()
    coordinator = Coordinator(launcher.spec, launcher.control, launcher.world_size, launcher.port)
    plane = launcher.control
    if trained:
        plane.mark_trained()
    for wid in [f"s0.{i}" for i in range(count)]:
        plane.register_spare(wid, 0)
        plane.set_ready(wid, control.SPARE_ANY)

    def fail_and_plan(wid, rank, g):
        plane.report_failure(control.Failure(worker=wid, rank=rank, code=1, reason="exit", wall_time=time.time()))
        deadline = time.monotonic() + 10
        while not plane.has_plan(g) and time.monotonic() < deadline:
            coordinator.step()
            time.sleep(0.01)
        return plane.plan(g)

    return plane, fail_and_plan


def test_a_rank_whose_spares_keep_failing_to_take_it_stops_the_job():
    """Rank 1 dies; each spare promoted to it fails before its generation caught up (a build that
    fails on every spare: seen with megatron-core's gloo twins on a spare's fake process group,
    which replaced spare after spare for 5 minutes; or a restore that fails after every rank
    arrived). The third failed takeover in a row stops the job, naming the rank and the spares;
    a takeover whose generation caught up starts the count over."""
    from hotspare.coordinator import MAX_FAILED_TAKEOVERS

    store, fail_and_plan = _coordinator_with_spares(5)
    assert fail_and_plan("a1", 1, 1).replaced == {"1": "s0.0"}
    store.set_caught_up(1, 3)  # generation 1 caught up: s0.0 took rank 1, then failed later
    assert fail_and_plan("s0.0", 1, 2).replaced == {"1": "s0.1"}  # counted as any failure
    assert fail_and_plan("s0.1", 1, 3).replaced == {"1": "s0.2"}  # 1 failed takeover
    for r in range(4):  # generation 3 formed, but s0.2 fails before it caught up (in its restore)
        store.raw.set(control.keys.arrived(3, r), "1")
    assert fail_and_plan("s0.2", 1, 4).replaced == {"1": "s0.3"}  # 2
    plan = fail_and_plan("s0.3", 1, 5)  # 3: stop
    assert MAX_FAILED_TAKEOVERS == 3 and plan.abort and not plan.replaced
    assert "rank 1: 3 spares in a row (s0.1, s0.2, s0.3) failed before their generation caught up" in plan.abort


def test_a_spare_that_lived_long_in_a_generation_that_formed_took_its_rank(monkeypatch):
    """No caught_up/<g> (a loop that never reports it): a promoted spare whose generation formed
    and that lived TAKEOVER_LIVED_S took its rank, so its failures never stop the job. One whose
    generation never formed is counted however long it lived (a spare that dies at the
    rendezvous's timeout on a broken node, every time)."""
    from hotspare import coordinator

    monkeypatch.setattr(coordinator, "TAKEOVER_LIVED_S", 0.0)
    store, fail_and_plan = _coordinator_with_spares(8)
    assert fail_and_plan("a1", 1, 1).replaced == {"1": "s0.0"}
    for g, (dead, spare) in enumerate([("s0.0", "s0.1"), ("s0.1", "s0.2"), ("s0.2", "s0.3"),
                                       ("s0.3", "s0.4")], start=2):
        for r in range(4):
            store.raw.set(control.keys.arrived(g - 1, r), "1")
        plan = fail_and_plan(dead, 1, g)
        assert not plan.abort and plan.replaced == {"1": spare}, plan
    assert fail_and_plan("s0.4", 1, 6).replaced == {"1": "s0.5"}  # generation 5 never formed: 1
    assert fail_and_plan("s0.5", 1, 7).replaced == {"1": "s0.6"}  # 2
    assert "rank 1: 3 spares in a row (s0.4, s0.5, s0.6) failed" in fail_and_plan("s0.6", 1, 8).abort


def test_a_spare_carried_into_a_later_generation_that_caught_up_took_its_rank():
    """Its first generation never caught up (another rank died while it formed), the next one did:
    when that spare fails later, it is not a failed takeover (the count stays below the stop)."""
    store, fail_and_plan = _coordinator_with_spares(6)
    assert fail_and_plan("a1", 1, 1).replaced == {"1": "s0.0"}
    assert fail_and_plan("a2", 2, 2).replaced == {"2": "s0.1"}  # generation 1 never formed
    store.set_caught_up(2, 3)  # s0.0 is in generation 2, which caught up
    assert fail_and_plan("s0.0", 1, 3).replaced == {"1": "s0.2"}  # not a failed takeover
    assert fail_and_plan("s0.2", 1, 4).replaced == {"1": "s0.3"}  # 1
    assert fail_and_plan("s0.3", 1, 5).replaced == {"1": "s0.4"}  # 2: still going


def test_on_an_accelerator_no_spare_is_sent_to_another_nodes_rank():
    """A spare that said it takes only its own node's ranks (``ready/<wid>`` = local: on a GPU
    every device of another node belongs to a live rank) is not promoted to rank 3 of node 1;
    the job stops saying why, once the spares still starting had their time."""
    store, fail_and_plan = _coordinator_with_spares(1, store_timeout_s=0.5)
    store.set_ready("s0.0", control.SPARE_LOCAL)
    plan = fail_and_plan("a3", 3, 1)
    assert plan.abort and not plan.replaced
    assert "only 1 ready spare(s) remain (on an accelerator a spare takes only a rank of its own node)" in plan.abort


def test_on_an_accelerator_a_replacement_nodes_spare_takes_any_rank():
    """A spare on a node that holds no rank (hotspare-run --spares-only on a replacement node,
    index 2 here) has its devices free: it takes node 1's rank."""

    store, fail_and_plan = _coordinator_with_spares(0)
    store.register_spare("s2.0", 2)
    store.set_ready("s2.0", control.SPARE_LOCAL)
    assert fail_and_plan("a3", 3, 1).replaced == {"3": "s2.0"}


def test_ranks_that_raise_before_the_first_step_stop_the_job_naming_the_script_not_the_spares():
    """Ranks exit with an error before the job's first step (a script or config bug: megatron's
    plain Adam once made the launcher suggest more spares, and each spare failed the same way):
    the job stops at once naming the script, not --spares-per-node. After the first step
    (``trained``) the same failures get the spares advice. A spare that is ready is not used for
    a rank that raised before the first step."""

    for trained in (False, True):
        store, fail_and_plan = _coordinator_with_spares(0, trained=trained, store_timeout_s=0.2)
        for rank in range(2):
            store.report_failure(control.Failure(worker=f"a{rank}", rank=rank, code=1, reason="exit",
                                                 wall_time=time.time()))
        plan = fail_and_plan("a3", 3, 1)
        assert plan.abort and not plan.replaced
        script = "exited with an error before the job's first step" in plan.abort
        assert script != trained and ("--spares-per-node" in plan.abort) == trained, plan.abort
    store, fail_and_plan = _coordinator_with_spares(2, trained=False)
    plan = fail_and_plan("a1", 1, 1)
    assert plan.abort and not plan.replaced and "rank 1 (error exit) exited with an error before" in plan.abort


def test_two_spares_whose_set_up_fails_the_same_way_stop_the_job_with_its_message():
    """A spare's set-up collective (setupguard.py) is reported as unfit/<wid>; the second spare
    failing with the same message stops the job with it instead of trying every spare."""

    store, fail_and_plan = _coordinator_with_spares(4)
    assert fail_and_plan("a1", 1, 1).replaced == {"1": "s0.0"}
    message = "this spare's script called torch.distributed.broadcast() after initialize"
    store.set_unfit("s0.0", message)
    assert fail_and_plan("s0.0", 1, 2).replaced == {"1": "s0.1"}
    store.set_unfit("s0.1", message)
    plan = fail_and_plan("s0.1", 1, 3)
    assert plan.abort and not plan.replaced
    assert plan.abort == f"spares s0.0, s0.1 failed the same way after taking a rank: {message}"


def test_a_stragglers_rank_goes_to_another_nodes_spare_and_its_nodes_spares_are_taken_last():
    """Issue 30: the node a straggler ran on may be the slow part. The coordinator, in process
    with its clock driven: rank 1 (node 0) is 3x slower than its peers; once it hands over, its
    rank goes to node 1's spare although node 0 has one, and node 0 is said to be avoided. A later
    failure on node 1 still gets node 0's spare (avoiding never costs a rank its spare)."""
    from hotspare.coordinator import Coordinator
    from hotspare.stragglers import LOOK_S

    launcher = launch.Launcher(launch.LaunchSpec(script=["unused"], nproc_per_node=4, logical_nodes=2,
                                                 spares_per_node=1))
    launcher.open_store()
    now = [100.0]
    coordinator = Coordinator(launcher.spec, launcher.control, launcher.world_size, launcher.port, clock=lambda: now[0])
    plane = launcher.control
    for wid, node in (("s0.0", 0), ("s1.0", 1)):
        plane.register_spare(wid, node)
        plane.set_ready(wid, control.SPARE_ANY)
    plane.publish_stragglers(control.StragglerPolicy(factor=2.0, window=3))
    for r in range(4):
        plane.report_compute(f"a{r}", control.Compute(0, [{"step": s, "seconds": 0.3 if r == 1 else 0.1}
                                                          for s in range(4)]))
    coordinator.step()
    [order] = plane.handovers(0)[0]
    assert (order.worker, order.cause, order.generation) == ("a1", "straggler", 0)

    def leave(worker, rank, code, reason):
        plane.report_failure(control.Failure(worker=worker, rank=rank, code=code, reason=reason,
                                             wall_time=time.time()))
        for r in range(4):
            if r != rank:
                plane.report_waiting(control.Waiting(worker=coordinator._current_plan().workers[str(r)], rank=r,
                                                     generation=coordinator.generation))
        now[0] += LOOK_S
        coordinator.step()
        now[0] += LOOK_S
        coordinator.step()

    leave("a1", 1, control.HANDED_OVER_EXIT_CODE, "handover")
    assert plane.plan(1).replaced == {"1": "s1.0"}
    leave("a3", 3, -9, "exit")
    assert plane.plan(2).replaced == {"3": "s0.0"}
