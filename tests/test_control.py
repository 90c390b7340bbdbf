"""The control plane's keys, messages and store operations (hotspare.control), in process on a
real TCPStore: worker ids round-trip and anything else is refused; each message parses back
from what it writes and a value of the wrong shape is refused naming its key and field; a list
entry that does not parse is skipped (named once), not acted on and not fatal."""
from __future__ import annotations

import json
import time

import pytest
import torch.distributed as dist

from hotspare import control
from hotspare.config import ConfigError
from hotspare.control import auth, keys
from hotspare.control.messages import parse


@pytest.fixture
def plane():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield control.ControlStore(store, auth.Signer(auth.new_secret(), "job1"))


def test_worker_ids_round_trip_and_nothing_else_parses():
    assert keys.parse_worker_id(keys.active_id(12)).rank == 12
    wid = keys.parse_worker_id(keys.spare_id(3, 1))
    assert (wid.node, wid.k, wid.spare) == (3, 1, True)
    for bad in ("", "a", "a-1", "a01", "s1", "s1.x", "b3", "a1 ", "../a1", "a1/x", 7, None):
        with pytest.raises(ValueError, match="not a worker id"):
            keys.parse_worker_id(bad)


MESSAGES = [
    control.Failure(worker="a1", rank=1, code=-9, reason="exit", wall_time=1.5, detect_s=0.25),
    control.Prepare(rank=2, world_size=4, generation=1, replaces="a2"),
    control.Waiting(worker="s0.1", rank=0, generation=3, timed_out=True, waited_s=30.0),
    control.Spare(worker="s1.0", node=1),
    control.Kill(worker="a3", detect_s=2.0),
    control.Plan(generation=2, world_size=2, workers={"0": "a0", "1": "s0.0"}, replaced={"1": "s0.0"},
                 failures=[{"worker": "a1", "rank": 1, "code": -9, "reason": "exit", "wall_time": 1.5, "detect_s": 0.0}],
                 failures_read=1),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_parses_back_from_what_it_writes(message):
    assert parse(type(message), control.messages.to_json(message), "k") == message


@pytest.mark.parametrize("cls, text, field", [
    (control.Failure, "not json", "not JSON"),
    (control.Failure, "[1, 2]", "not a JSON object"),
    (control.Failure, '{"worker": "a1", "rank": 1, "code": 9, "reason": "exit"}', "missing field(s) ['wall_time']"),
    (control.Failure, '{"worker": "a1", "rank": 1, "code": 9, "reason": "exit", "wall_time": 1, "x": 2}',
     "unknown field(s) ['x']"),
    (control.Failure, '{"worker": "a1", "rank": "1", "code": 9, "reason": "exit", "wall_time": 1}', "'rank'"),
    (control.Failure, '{"worker": "a1", "rank": true, "code": 9, "reason": "exit", "wall_time": 1}', "'rank'"),
    (control.Failure, '{"worker": "a1", "rank": 1, "code": 9, "reason": "exit", "wall_time": NaN}', "'wall_time'"),
    (control.Failure, '{"worker": "x9", "rank": 1, "code": 9, "reason": "exit", "wall_time": 1}', "'worker'"),
    (control.Plan, '{"generation": 1, "world_size": 1, "workers": {"0": "rm -rf"}}', "'workers'"),
    (control.Plan, '{"generation": 1, "world_size": 1, "workers": {"x": "a0"}}', "'workers'"),
    (control.Kill, '{"worker": "a1", "detect_s": Infinity}', "'detect_s'"),
])
def test_a_value_of_the_wrong_shape_is_refused_naming_its_key_and_field(cls, text, field):
    with pytest.raises(control.BadMessage) as info:
        parse(cls, text, "fail/7")
    assert "'fail/7'" in str(info.value) and field in str(info.value)


def test_a_list_entry_that_does_not_parse_is_skipped_and_named_once(plane, capfd):
    """A stranger's entry (under the list's public names: the job's own are under names only its
    processes know) is named, never read; a signed entry that is not a Failure (a bug's) is
    skipped, named; the valid ones around them are read."""
    good = control.Failure(worker="a1", rank=1, code=-9, reason="exit", wall_time=time.time())
    plane.report_failure(good)
    index = plane.raw.add(keys.FAIL_COUNT, 1) - 1  # a stranger's entry, through the public counter
    plane.raw.set(f"{keys.FAIL}{index}", "{not json")
    plane.append(keys.FAIL, "{not json either}")  # signed, but not a Failure (a bug's)
    plane.report_failure(good)
    cursor = control.ListCursor(keys.FAIL)
    assert plane.failures(cursor) == ([good, good], 3)
    err = capfd.readouterr().err
    assert "control store key 'fail/0': not signed with this job's secret" in err
    assert "control store key 'fail/<job>/1': not JSON" in err
    assert plane.failures(cursor) == ([], 3)
    assert capfd.readouterr().err == ""  # each named once


def test_a_counted_entry_never_written_is_skipped_after_a_while(plane, capfd):
    """A writer that died between counting an entry and writing it does not block the entries
    after it: they are read at once, and the hole is skipped after HOLE_S (the store's clock,
    driven here)."""
    from hotspare.control import lists

    now = [100.0]
    plane.clock = lambda: now[0]
    plane.raw.add(f"{lists.private_prefix(plane.signer, keys.FAIL)}count", 1)  # index 0 counted, never written
    good = control.Failure(worker="a1", rank=1, code=-9, reason="exit", wall_time=1.0)
    plane.report_failure(good)
    cursor = control.ListCursor(keys.FAIL)
    assert plane.failures(cursor) == ([good], 0)  # index 0 perhaps still being written
    now[0] += lists.HOLE_S - 0.01
    assert plane.failures(cursor) == ([], 0)
    now[0] += 0.02
    assert plane.failures(cursor) == ([], 2)
    assert "'fail/<job>/0': counted in 'fail/<job>/count' but not written" in capfd.readouterr().err


def test_values_of_another_job_or_a_stranger_read_as_absent(plane):
    """Signed with another secret, with this secret for another job, or unsigned: none is acted on."""
    other = control.ControlStore(plane.raw, auth.Signer(auth.new_secret(), "job1"))
    other.abort("forged")
    other.shut_down()
    assert plane.abort_message() is None and not plane.is_shut_down()
    elsewhere = control.ControlStore(plane.raw, plane.signer.for_job("job2"))
    elsewhere.write_plan(control.Plan(1, 1, {"0": "a0"}))
    assert not plane.superseded(0)
    plane.raw.set(keys.SHUTDOWN, "1")
    assert not plane.is_shut_down()
    plane.shut_down()
    assert plane.is_shut_down()
    plane.publish_job("job1")
    assert plane.job_id() == "job1"
    with pytest.raises(control.BadMessage, match="another --job-secret-file"):
        other.job_id()


def test_a_secret_file_must_be_the_owners_alone(tmp_path):
    path = tmp_path / "secret"
    path.write_text(auth.new_secret().hex())
    path.chmod(0o644)
    with pytest.raises(auth.SecretError, match="chmod 600"):
        auth.read_secret_file(str(path))
    path.chmod(0o600)
    assert len(auth.read_secret_file(str(path))) >= auth.MIN_SECRET_BYTES
    path.write_text("short")
    with pytest.raises(auth.SecretError, match="at least"):
        auth.read_secret_file(str(path))


def test_single_values_of_the_wrong_shape_are_refused_naming_their_key(plane):
    """Signed by the job, but not what the key holds (a bug's): refused naming the key."""
    plane.put(keys.plan(1), json.dumps({"generation": 1, "world_size": 1}))
    with pytest.raises(control.BadMessage, match="'plan/1': missing field"):
        plane.plan(1)
    plane.put(keys.plan(2), control.Plan(generation=3, world_size=1, workers={"0": "a0"}).to_json())
    with pytest.raises(control.BadMessage, match="'plan/2': holds the plan of generation 3"):
        plane.plan(2)
    plane.write_plan(control.Plan(generation=3, world_size=1, workers={"0": "a0"}))
    plane.raw.set(keys.plan(4), plane.raw.get(keys.plan(3)))  # a signed plan moved to another key
    assert not plane.has_plan(4)
    plane.put(keys.heartbeat("a0"), "many")
    with pytest.raises(control.BadMessage, match="'hb/a0'"):
        plane.beats("a0")
    plane.put(keys.heartbeat_timeout("a0"), "nan")
    with pytest.raises(control.BadMessage, match="'hb/a0/timeout'.*finite"):
        plane.beat_timeout("a0")
    for bad in ("0", "-2.5", "inf"):  # a silence of 0 s or less would have the launcher kill at once
        plane.put(keys.heartbeat_timeout("a0"), bad)
        with pytest.raises(control.BadMessage, match="'hb/a0/timeout'.*finite number > 0"):
            plane.beat_timeout("a0")
    plane.put(keys.ready("s0.0"), "1")
    with pytest.raises(control.BadMessage, match="'ready/s0.0'"):
        plane.ready_scope("s0.0")


def test_the_newest_plan_and_a_spares_orders(plane):
    assert plane.current_plan(2) == control.Plan(0, 2, {"0": "a0", "1": "a1"})
    plan = control.Plan(1, 2, {"0": "a0", "1": "s0.0"}, replaced={"1": "s0.0"})
    plane.send_orders(plan)
    assert plane.current_plan(2) == plan and plane.superseded(0) and not plane.superseded(1)
    assert plane.order_for("s0.0") == 1 and plane.raw.check([keys.wake("s0.0")])
    assert plane.order_for("s0.1") is None


def test_the_coordinator_goes_on_past_entries_that_do_not_parse():
    """A failure report, a spare and a survivor's report that do not parse (a stranger's, or a
    bug's) are skipped; the valid ones around them are planned for as usual."""
    from hotspare import launch
    from hotspare.coordinator import Coordinator

    launcher = launch.Launcher(launch.LaunchSpec(script=["unused"], nproc_per_node=2, logical_nodes=2,
                                                 settle_s=0.0))
    launcher.open_store()
    plane = launcher.control
    coordinator = Coordinator(launcher.spec, plane, launcher.world_size, launcher.port)
    for prefix in (keys.SPARE, keys.FAIL, keys.WAIT):
        plane.append(prefix, '{"worker": "a0; kill"}')
    plane.mark_trained()
    plane.register_spare("s0.0", 0)
    plane.set_ready("s0.0", control.SPARE_ANY)
    plane.report_failure(control.Failure(worker="a1", rank=1, code=-9, reason="exit", wall_time=time.time()))
    plane.report_waiting(control.Waiting(worker="a0", rank=0, generation=0))
    deadline = time.monotonic() + 10
    while not plane.has_plan(1) and time.monotonic() < deadline:
        coordinator.step()
        time.sleep(0.01)
    assert plane.plan(1).replaced == {"1": "s0.0"}


@pytest.mark.parametrize("way", ["unsigned", "forged", "malformed"])
def test_what_a_stranger_writes_in_any_key_family_reads_as_absent_and_is_named(plane, capfd, way):
    """Every key family (probes.FAMILIES, the fault matrix's control probes): a well-formed value
    with no signature, one signed with another secret under the job's id, or one that looks
    signed over text that does not parse. The job's own reader of each treats it as absent (a
    list: no entry) and names the key; none raises but job/id and job/fingerprint, which refuse
    the joining process."""
    from hotspare.testing import matrix, probes

    plane.publish_job("job1")
    t = probes.Target(4)
    written = dict(zip(probes.FAMILIES, probes.write(plane.raw, way, probes.FAMILIES, t)))
    capfd.readouterr()
    absent = {"plan": lambda: plane.has_plan(1), "prepare": lambda: plane.prepare_for(t.spare),
              "order": lambda: plane.order_for(t.spare), "ready": lambda: plane.ready_scope(t.spare),
              "hb": lambda: plane.beats(t.live), "hb_timeout": lambda: plane.beat_timeout(t.live),
              "node_hb": lambda: plane.node_beats(t.node), "alarm": lambda: plane.text(written["alarm"]),
              "exited": lambda: plane.text(written["exited"]), "abort": plane.abort_message,
              "shutdown": plane.is_shut_down, "finished": lambda: plane.finished(t.rank), "trained": plane.trained,
              "caught_up": lambda: plane.caught_up(1), "unfit": lambda: plane.unfit(t.spare),
              "compute": lambda: plane.compute(t.live), "stragglers": plane.stragglers,
              "handover": lambda: plane.handovers(0)[0], "drain": lambda: plane.drains(0)[0],
              "drained": lambda: plane.drained(t.node), "moved": lambda: plane.moved(t.rank),
              "fail": lambda: plane.failures(0)[0], "spare": lambda: plane.spares(0)[0],
              "wait": lambda: plane.waiting(0)[0], "kill": lambda: plane.kills(0)[0]}
    assert set(absent) | {"job_id", "fingerprint"} == set(probes.FAMILIES)
    for family, read in absent.items():
        assert read() in (None, False, 0, []), family
    for read in (plane.job_id, lambda: plane.claim_fingerprint("mine")):
        with pytest.raises(control.BadMessage, match="not signed"):
            read()
    err = capfd.readouterr().err
    named = [k for f, k in written.items() if f not in ("job_id", "fingerprint")]
    assert all(f"control store key {k!r}: not signed" in err for k in named), err
    assert matrix.parse_probe(f"{way}:all+kill") == (way, probes.FAMILIES, True)
    assert matrix.parse_probe(f"{way}:plan/hb") == (way, ("plan", "hb"), False)
    for bad in (f"{way}:nope", "replay+kill", f"{way}:", "shout"):
        with pytest.raises(ConfigError, match="control_probes"):
            matrix.parse_probe(bad)
