"""Control-plane hardening (issue 28): nobody outside the job can act on it, no bad value kills
it, no process outlives its launcher, exit codes tell the truth. Each test pins one gap an audit
found: a stranger (a plain TCPStore client on 127.0.0.1, a free port) moving or corrupting a
list's counter, replayed heartbeats, a plan's failures of the wrong shape, the launcher's last
line, flags that end up in file names, stale extension-build locks, fencing's bounds. Needs
torch (gloo not used) and megatron-core for the config test; processes are tiny Python scripts;
every wait is bounded, and clocks are injected where time matters."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import psutil
import pytest
import torch.distributed as dist

from hotspare import control, launch
from hotspare.control import auth, keys, lists

FAILURE = control.Failure(worker="a1", rank=1, code=-9, reason="exit", wall_time=1.0)


@pytest.fixture
def job():
    """The job's store on 127.0.0.1 (a free port), its signed view on an injected clock, and a
    stranger's plain client."""
    listener = launch.listen_socket("127.0.0.1", 0)
    master = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5), master_listen_fd=listener.fileno())
    listener.detach()
    now = [100.0]
    plane = control.ControlStore(master, auth.Signer(auth.new_secret(), "job-h"), clock=lambda: now[0])
    stranger = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    yield SimpleNamespace(plane=plane, stranger=stranger, now=now)


# ---- 1, 2: lists ---------------------------------------------------------------------------


def test_a_word_in_a_lists_counter_does_not_cut_the_job_from_its_store(job):
    """A TCPStore ``add`` on a key that holds a word drops the caller's connection for good (the
    store server fails to parse it): one ``set fail/count x`` once cut node 0's launcher off its
    own store. The job never adds to, nor counts by, the public counters."""
    for counter in (keys.FAIL_COUNT, keys.SPARE_COUNT, keys.WAIT_COUNT, keys.KILL_COUNT):
        job.stranger.set(counter, "x")
    job.plane.report_failure(FAILURE)
    job.plane.ask_kill("a0", 1.0)
    assert job.plane.failures(control.ListCursor(keys.FAIL))[0] == [FAILURE]
    assert [k.worker for k in job.plane.kills(control.ListCursor(keys.KILL))[0]] == ["a0"]
    assert job.plane.spares(control.ListCursor(keys.SPARE)) == ([], 0)
    assert job.plane.failure_count() == 1
    job.plane.shut_down()  # the connection still works
    assert job.plane.is_shut_down()


def test_a_stranger_moving_a_counter_far_ahead_delays_nothing_and_is_said_once(job, capfd):
    """A stranger adds 1000 to ``fail/count`` and writes forged entries at the indices a writer
    would take next: the job's next failure is read at the first look, not after 1000 waits; the
    stranger's entries are never read as the job's; the log names the counter once and the
    holes in one line, after one shared wait."""
    job.stranger.add(keys.FAIL_COUNT, 1000)
    for i in range(1000, 1003):  # where a writer counting on the public counter would write next
        job.stranger.set(f"{keys.FAIL}{i}", control.messages.to_json(FAILURE))
    job.stranger.add(keys.FAIL_COUNT, 3)
    job.plane.report_failure(FAILURE)
    cursor = control.ListCursor(keys.FAIL)
    assert job.plane.failures(cursor) == ([FAILURE], 1)
    job.now[0] += lists.HOLE_S
    assert job.plane.failures(cursor) == ([], 1)
    job.now[0] += lists.HOLE_S
    assert job.plane.failures(cursor) == ([], 1)
    job.plane.report_failure(FAILURE)  # a later real one: read at once
    assert job.plane.failures(cursor) == ([FAILURE], 2)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "'fail/" in line]
    assert len(lines) == 3, err  # the counter moved; the forged entries; the holes
    assert "'fail/count': moved far ahead by someone other than this job" in err
    assert "'fail/1000' .. 'fail/1002' (3 values): not signed" in err
    assert f"{lists.PUBLIC_PEEK - 3} entries counted in 'fail/count' but not written" in err


def test_holes_in_the_jobs_own_list_share_one_wait_and_the_entries_after_them_are_read_at_once(job, capfd):
    """Writers that died between counting and writing (50 of them): the entry after their holes
    is read at the first look; the holes wait HOLE_S together, then go in one line."""
    job.plane.raw.add(f"{lists.private_prefix(job.plane.signer, keys.WAIT)}count", 50)
    report = control.Waiting(worker="a0", rank=0, generation=0)
    job.plane.report_waiting(report)
    cursor = control.ListCursor(keys.WAIT)
    assert job.plane.waiting(cursor) == ([report], 0)
    job.now[0] += lists.HOLE_S / 2
    job.plane.report_waiting(report)
    assert job.plane.waiting(cursor) == ([report], 0)
    job.now[0] += lists.HOLE_S / 2
    assert job.plane.waiting(cursor) == ([], 52)
    err = capfd.readouterr().err
    assert err.count("control store") == 1 and "50 entries counted in 'wait/<job>/count' but not written" in err


def test_the_successor_policy_acts_only_on_signed_failures(job, monkeypatch, capfd):
    """A pending successor starts early only for a failure the job signed and the plan does not
    answer; a stranger bumping ``fail/count`` or writing failure entries starts nothing."""
    from hotspare.launch import successors

    clock = [100.0]
    started = []
    policy = successors.Successors(30.0, lambda: job.plane, lambda wid, node: started.append(wid),
                                   clock=lambda: clock[0])
    job.plane.report_failure(FAILURE)  # the failure the plan answers
    plan = control.Plan(1, 2, {"0": "a0", "1": "s0.0"}, replaced={"1": "s0.0"},
                        failures=[json.loads(control.messages.to_json(FAILURE))], failures_read=1)
    policy.register("s0.1", 0, plan)
    job.stranger.add(keys.FAIL_COUNT, 5)
    job.stranger.set(f"{keys.FAIL}4", control.messages.to_json(control.Failure("a0", 0, 9, "exit", 1.0)))
    for _ in range(3):
        policy.start_due(1)
    assert started == []
    job.plane.report_failure(control.Failure("a0", 0, 9, "exit", 2.0))
    policy.start_due(1)
    assert started == ["s0.1"] and "starting spare s0.1 on node 0 (another failure came)" in capfd.readouterr().err


# ---- 3: replay ---------------------------------------------------------------------------------


def test_replaying_two_old_signed_beats_does_not_hide_a_hung_worker(job):
    """A stranger reads ``hb/a0`` twice while the worker beats, then writes the two signed values
    back in turn after the worker hung: each is a change, but neither is past the last beat
    counted, so the worker is found silent after its timeout."""
    worker = launch.Worker("a0", 0, SimpleNamespace(pid=os.getpid()), rank=0)
    beats = control.ControlStore(job.plane.raw, job.plane.signer)  # the worker's own connection
    try:
        beats.start_beating("a0", 1.0)
        recorded = []
        for count, t in ((1, 100.0), (2, 100.5)):
            beats.beat("a0", count)
            recorded.append(job.stranger.get(keys.heartbeat("a0")))
            assert worker.heard(job.plane.beats("a0"), job.plane.beat_timeout("a0"), t) is None
        silent = None
        for step in range(1, 20):  # the worker hung at 100.5: the stranger replays its two beats
            job.stranger.set(keys.heartbeat("a0"), recorded[step % 2])
            silent = worker.heard(job.plane.beats("a0"), None, 100.5 + 0.1 * step)
            if silent is not None:
                break
        assert silent is not None and silent > 1.0
    finally:
        worker.finish()


def test_beats_go_on_upwards_across_heartbeats_and_an_old_goodbye_is_not_news(job):
    """A second Heartbeat of the same worker id goes on past the first one's beats and goodbye
    (the launcher counts it); the first one's goodbye, replayed, does not stop the watch."""
    worker = launch.Worker("a0", 0, SimpleNamespace(pid=os.getpid()), rank=0)
    first, second = (control.ControlStore(job.plane.raw, job.plane.signer) for _ in range(2))
    try:
        first.start_beating("a0", 1.0)
        first.beat("a0", 1)
        first.say_goodbye("a0")
        goodbye = job.stranger.get(keys.heartbeat("a0"))
        assert worker.heard(job.plane.beats("a0"), 1.0, 100.0) is None and worker.beat_timeout == 0.0
        second.start_beating("a0", 1.0)
        assert worker.heard(job.plane.beats("a0"), 1.0, 100.5) is None and worker.beat_timeout == 1.0
        job.stranger.set(keys.heartbeat("a0"), goodbye)
        assert worker.heard(job.plane.beats("a0"), None, 101.0) is None
        assert worker.heard(job.plane.beats("a0"), None, 102.0) == pytest.approx(1.5)
    finally:
        worker.finish()


def test_replaying_a_nodes_old_beats_does_not_keep_a_lost_node(job):
    """Node 1's launcher beats twice and goes silent; a stranger replays its two signed beats in
    turn: node 0 still declares it lost after --node-timeout-s (the coordinator's clock)."""
    from hotspare.coordinator import Coordinator

    spec = launch.LaunchSpec(script=["unused"], nnodes=2, nproc_per_node=1, node_timeout_s=1.0)
    now = [100.0]
    coordinator = Coordinator(spec, job.plane, 2, job.plane.raw.port, clock=lambda: now[0])
    recorded = []
    for beat in (1, 2):
        job.plane.beat_node(1, beat)
        recorded.append(job.stranger.get(keys.node_heartbeat(1)))
        coordinator.step()
    for step in range(1, 30):
        job.stranger.set(keys.node_heartbeat(1), recorded[step % 2])
        now[0] += 0.1
        coordinator.step()
        if 1 in coordinator._lost_nodes:
            break
    assert coordinator._lost_nodes == {1} and now[0] > 101.0


# ---- 4: a plan's failures ------------------------------------------------------------------------


@pytest.mark.parametrize("failures, field", [
    ([{"worker": "a0"}], "missing field(s) ['code', 'rank', 'reason', 'wall_time'] of a Failure in failures[0]"),
    ([{"worker": "a0", "rank": 0, "code": "9", "reason": "exit", "wall_time": 1}], "'failures[0].code'"),
    ([{"worker": "a0", "rank": 0, "code": 9, "reason": "bored", "wall_time": 1}], "'failures[0].reason'"),
    ([{"worker": "rm -rf", "rank": 0, "code": 9, "reason": "exit", "wall_time": 1}], "'failures[0].worker'"),
    ([{"worker": "a0", "rank": 0, "code": 9, "reason": "exit", "wall_time": 1, "x": 1}], "unknown field(s) ['x']"),
])
def test_each_failure_of_a_plan_is_parsed_as_a_failure(failures, field):
    text = json.dumps({"generation": 1, "world_size": 1, "workers": {"0": "a0"}, "failures": failures, "abort": "x"})
    with pytest.raises(control.BadMessage) as info:
        control.Plan.from_json(text, "plan/1")
    assert "'plan/1'" in str(info.value) and field in str(info.value)


def test_a_plan_that_stopped_the_job_gives_its_first_failures_code():
    from hotspare.launch.exits import plan_exit_code

    failure = json.loads(control.messages.to_json(FAILURE))
    assert plan_exit_code([failure]) == 128 + 9
    assert plan_exit_code([{**failure, "code": 7}]) == 7
    assert plan_exit_code([]) == 1


# ---- 5: the last line ----------------------------------------------------------------------------


def _last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_a_refused_flag_ends_with_the_exit_line(capfd):
    assert launch.main(["--job-id", "a/b", "/nonexistent/train.py"]) == 2
    err = capfd.readouterr().err
    assert "[hotspare-run] error: --job-id='a/b' must be 1 to 64 of the characters" in err
    assert _last_line(err).startswith("[hotspare-run] exit 2: refused: --job-id='a/b'"), err
    assert launch.main(["--nproc-per-node", "two", "/nonexistent/train.py"]) == 2
    assert _last_line(capfd.readouterr().err) == \
        "[hotspare-run] exit 2: refused: the command line (argparse's message above)"


def test_an_unexpected_error_ends_with_its_traceback_then_the_exit_line(monkeypatch, capfd):
    def boom(_launcher):
        raise RuntimeError("boom")

    monkeypatch.setattr(launch.Launcher, "start", boom)
    assert launch.main(["--no-keeper", "train.py"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" in err and err.index("Traceback") < err.index("exit 1:")
    assert _last_line(err) == ("[hotspare-run] exit 1: unexpected error in hotspare-run: RuntimeError: boom "
                               "(traceback above)"), err


def test_a_finished_job_ends_with_the_exit_line_after_everything_else(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import sys\nsys.exit(0)\n")
    proc = subprocess.run([sys.executable, "-m", "hotspare.launch", "--nproc-per-node", "2", "--job-id",
                           "hardening-ok", str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _last_line(proc.stderr) == "[hotspare-run] exit 0: job hardening-ok: training finished on all 2 ranks", \
        proc.stderr


def test_a_plan_that_stops_the_job_is_said_on_every_node(job, tmp_path, capfd):
    """Node 1's launcher follows node 0's abort plan: it says why, and ends with that cause."""
    secret = auth.write_secret_file(str(tmp_path / "secret"))
    plane = control.ControlStore(job.plane.raw, auth.Signer(auth.read_secret_file(secret), "job-h"))
    plane.publish_job("job-h")
    spec = launch.LaunchSpec(script=["unused"], nnodes=2, node_rank=1, master_port=job.plane.raw.port,
                             job_secret_file=secret, keeper=False)
    node1 = launch.Launcher(spec)
    node1.open_store()
    failure = json.loads(control.messages.to_json(FAILURE))
    plane.write_plan(control.Plan(1, 2, {"0": "a0", "1": "a1"}, failures=[failure], abort="rank 1 failed, no spare"))
    # TCPStore's set is not answered: a read on the writer's own connection orders it before
    # node 1's read on another (seen under load: node 1 looked first and found no plan).
    assert plane.has_plan(1)
    node1._follow_plans()
    assert node1.exit_code == 137 and "rank 1 failed, no spare" in node1.exit_cause
    assert "[hotspare-run] the coordinator stopped the job: rank 1 failed, no spare" in capfd.readouterr().err


# ---- 6: flags and files ------------------------------------------------------------------------


def test_an_advertised_address_must_resolve(monkeypatch):
    import socket

    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):  # (no lookup leaves this machine)
        if host == "nic0.example":
            raise socket.gaierror(-2, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with pytest.raises(ValueError, match="--advertise-addr='nic0.example' does not resolve"):
        launch.LaunchSpec(script=["x.py"], advertise_addr="nic0.example").validate()


@pytest.mark.parametrize("job_id", ["a/b", "../x", "a b", "x" * 65, "job\n", "ü"])
def test_a_job_id_is_safe_characters_only(job_id):
    with pytest.raises(ValueError, match="--job-id=.* must be 1 to 64 of the characters"):
        launch.LaunchSpec(script=["x.py"], job_id=job_id).validate()
    launch.LaunchSpec(script=["x.py"], job_id="run-3_v1.2").validate()


def test_a_megatron_config_file_that_is_not_json_is_named_with_its_line_and_column(tmp_path):
    from hotspare.config import ConfigError
    from hotspare.integrations.megatron.setup import parse_config

    path = tmp_path / "hs.json"
    path.write_text('{"hotspare": {\n  "enabled": true,\n  oops}\n}')
    with pytest.raises(ConfigError, match=f"hotspare config {path}: not JSON at line 3, column 3"):
        parse_config(str(path))
    with pytest.raises(ConfigError, match="cannot read it"):
        parse_config(str(tmp_path / "missing.json"))


# ---- 7: build locks ------------------------------------------------------------------------------


HOLD = textwrap.dedent("""
    import sys
    from torch.utils.file_baton import FileBaton
    baton = FileBaton(sys.argv[1])
    assert baton.try_acquire()
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
    baton.release()
""")


def test_a_build_lock_nobody_holds_is_removed_and_a_held_one_is_kept(tmp_path, capfd, monkeypatch):
    from hotspare.launch import buildlocks

    monkeypatch.setattr(buildlocks, "in_container", lambda: False)
    monkeypatch.setattr(buildlocks, "RECHECK_S", 0.0)
    for name in ("fused_adam", "cpu_adam"):
        (tmp_path / name).mkdir()
    (tmp_path / "fused_adam" / "lock").touch()  # its build was killed: nobody has it open
    held = str(tmp_path / "cpu_adam" / "lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, held], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        if buildlocks.file_system_of(str(tmp_path))[1] not in buildlocks.LOCAL_FILE_SYSTEMS:
            pytest.skip(f"{tmp_path} is not on a local file system here")
        assert launch.clear_stale_build_locks(str(tmp_path)) == [str(tmp_path / "fused_adam" / "lock")]
        assert not (tmp_path / "fused_adam" / "lock").exists() and os.path.exists(held)
        err = capfd.readouterr().err
        assert f"removed {tmp_path / 'fused_adam' / 'lock'}: no process holds it" in err
        assert f"a build of the 'cpu_adam' op is running (pid {holder.pid}" in err
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert not os.path.exists(held)


def test_a_build_lock_on_a_shared_file_system_is_named_at_once_with_what_to_remove(tmp_path, capfd, monkeypatch):
    from hotspare.launch import buildlocks

    monkeypatch.setattr(buildlocks, "file_system_of", lambda path: ("/home", "nfs4"))
    (tmp_path / "fused_adam").mkdir()
    lock = tmp_path / "fused_adam" / "lock"
    lock.touch()  # seconds old, not 10 minutes: said at once
    assert launch.clear_stale_build_locks(str(tmp_path)) == [str(lock)]
    assert lock.exists()
    err = capfd.readouterr().err
    assert "nfs4 file system (/home), which other machines may share" in err and f"rm {lock}" in err


# ---- 8: fencing ----------------------------------------------------------------------------------


LEAVER = textwrap.dedent("""
    import subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
""")


def test_fencing_kills_every_workers_session_and_bounds_the_keepers_grace(monkeypatch, capfd):
    """A fenced node kills what its workers left in their sessions (a worker that exited may
    leave DataLoader workers: they poll for their parent only every 5 s) and gives its keepers
    FENCE_GRACE_S, not --term-grace: with the default flags all is gone within 15 s."""
    from hotspare.launch import fencing, processes

    spec = launch.LaunchSpec(script=["unused"], nnodes=2, node_rank=1, master_port=1)
    assert spec.node_timeout_s * 1.1 + min(spec.term_grace_s, fencing.FENCE_GRACE_S) <= 15.0
    proc = processes.spawn(["-c", LEAVER], dict(os.environ))
    worker = launch.Worker("a1", 1, proc, rank=1)
    proc.wait(timeout=60)  # the worker exited; its child lives on in its session
    session = [p for p in psutil.process_iter() if _pgid(p.pid) == proc.pid]
    assert len(session) == 1, "the worker's child did not start"
    child = session[0]
    graces = []
    keepers = SimpleNamespace(stop=graces.append)
    monkeypatch.setattr(fencing.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    try:
        with pytest.raises(SystemExit) as info:
            fencing.fence(spec, [worker], keepers, 11.0)
        assert info.value.code == launch.FENCED_EXIT_CODE and graces == [fencing.FENCE_GRACE_S]
        gone, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, "the worker's child outlived the fencing"
        assert _last_line(capfd.readouterr().err).startswith("[hotspare-run] exit 4: node 1 fenced itself")
    finally:
        worker.finish()
        for p in psutil.process_iter():
            if _pgid(p.pid) == proc.pid:
                p.kill()


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1
