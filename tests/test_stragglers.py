"""Slow ranks: the compute clock's per-step forward time and the straggler test (pure)."""
from __future__ import annotations

import pytest
import torch

from hotspare import stragglers
from hotspare.config import ConfigError, HotspareConfig, from_mapping


def steady(ranks=4, steps=10, seconds=0.1) -> dict:
    return {r: {s: seconds for s in range(steps)} for r in range(ranks)}


def test_a_rank_three_times_slower_for_the_window_is_a_straggler():
    reports = steady()
    for s in range(6, 10):
        reports[2][s] = 0.3
    found = stragglers.stragglers(reports, {}, factor=1.5, window=4)
    assert list(found) == [2] and found[2] == pytest.approx(3.0)


def test_one_slow_step_of_the_same_size_is_not_a_straggler():
    reports = steady()
    reports[1][8] = 0.3  # a garbage collection, a checkpoint write
    assert stragglers.stragglers(reports, {}, factor=1.5, window=2) == {}
    reports[1][9] = 0.3  # now two in a row: the window is full
    assert list(stragglers.stragglers(reports, {}, factor=1.5, window=2)) == [1]


def test_only_steps_every_peer_reported_count_and_a_short_history_decides_nothing():
    reports = steady(steps=3)
    reports[0] = {s: 0.5 for s in range(3)}
    reports[3] = {0: 0.1, 1: 0.1}  # rank 3 has not reported step 2 yet
    assert stragglers.stragglers(reports, {}, factor=1.5, window=3) == {}
    assert list(stragglers.stragglers(reports, {}, factor=1.5, window=2)) == [0]


def test_ranks_are_compared_within_their_peer_class_and_a_class_needs_three():
    # Two pipeline stages: stage 1 computes twice as long as stage 0 (the loss head), and is not slow.
    reports = {r: {s: (0.1 if r < 3 else 0.2) for s in range(5)} for r in range(6)}
    peers = {r: r // 3 for r in range(6)}
    assert stragglers.stragglers(reports, peers, factor=1.5, window=3) == {}
    # Compared across stages, the stage that computes more looks slow.
    assert sorted(stragglers.stragglers(reports, {}, factor=1.5, window=3)) == [3, 4, 5]
    reports[4] = {s: 0.6 for s in range(5)}
    assert list(stragglers.stragglers(reports, peers, factor=1.5, window=3)) == [4]
    two = {0: {0: 0.1, 1: 0.1}, 1: {0: 0.9, 1: 0.9}}
    assert stragglers.stragglers(two, {}, factor=1.5, window=2) == {}


def test_what_cannot_be_measured_is_named():
    assert stragglers.measurable() is None
    assert "tensor parallelism" in stragglers.measurable(tensor_parallel=2)


def test_timing_the_leaves_leaves_out_what_an_earlier_pre_hook_waited_for():
    """ZeRO 3: DeepSpeed's pre-hook on each module gathers its parameters, waiting for the other
    ranks. The clock's hooks, registered after it, time each leaf from the end of that wait. A
    clock read here: the "gather" moves it 100, each leaf's compute 1."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    assert [type(m).__name__ for m in stragglers.leaves(model)] == ["Linear", "Linear", "ReLU"]
    now = [0]

    def advance(by):
        def hook(module, args):
            now[0] += by
        return hook

    for m in model.modules():  # registered first, as DeepSpeed's are at engine init
        m.register_forward_pre_hook(advance(100))
    clock = stragglers.ComputeClock(stragglers.leaves(model), clock=lambda: now[0])
    for m in stragglers.leaves(model):  # the leaf's own compute
        m.register_forward_pre_hook(advance(1))
    model(torch.ones(4))
    assert clock.take(0) == (0, 3) and now[0] == 503  # five gathers waited for, three leaves computed
    clock.close()


class Slow(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_the_clock_sums_the_outermost_forwards_of_a_step_and_ignores_the_rest():
    ticks = iter(range(100))
    inner = torch.nn.Linear(2, 2)
    outer = Slow(inner)
    clock = stragglers.ComputeClock([outer, inner], clock=lambda: next(ticks))  # one tick per reading
    outer(torch.ones(2))  # outer 0..3 (inner's own readings are ignored: nested)
    outer(torch.ones(2))  # second micro-batch: 2 ticks
    assert clock.take(7) == (7, 2)
    torch.ones(2) @ torch.ones(2)  # compute outside the forward is not counted
    assert clock.take(8) is None  # no forward in step 8
    clock.close()
    outer(torch.ones(2))
    assert clock.take(9) is None  # hooks removed


class FakeEvent:
    """An accelerator event stand-in recording when it was recorded (in ms)."""
    now = 0.0

    def __init__(self):
        self.t = None
        self.synced = False

    def record(self):
        FakeEvent.now += 5.0
        self.t = FakeEvent.now

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, other):
        return other.t - self.t


def test_on_an_accelerator_a_step_is_read_one_step_later_from_its_events():
    m = torch.nn.Linear(2, 2)
    clock = stragglers.ComputeClock([m], events=FakeEvent)
    m(torch.ones(2))
    assert clock.take(0) is None  # its events may still be running
    m(torch.ones(2))
    assert clock.take(1) == (0, pytest.approx(0.005))


def test_the_config_section_is_strict():
    cfg = from_mapping(HotspareConfig, {"stragglers": {"enabled": True, "factor": 3, "window": 4}})
    assert (cfg.stragglers.enabled, cfg.stragglers.factor, cfg.stragglers.window) == (True, 3.0, 4)
    assert HotspareConfig().stragglers.enabled is False
    for bad, key in (({"factor": 1}, "stragglers.factor"), ({"window": 1}, "stragglers.window"),
                     ({"factor": float("inf")}, "stragglers.factor"), ({"windw": 3}, "stragglers.windw")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            from_mapping(HotspareConfig, {"stragglers": bad})


@pytest.fixture
def plane(tmp_path):
    """A signed control store on 127.0.0.1 (a free port) and a stranger's plain client."""
    import datetime
    from types import SimpleNamespace

    import torch.distributed as dist

    from hotspare import control, launch
    from hotspare.control import auth

    listener = launch.listen_socket("127.0.0.1", 0)
    master = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5), master_listen_fd=listener.fileno())
    listener.detach()
    stranger = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    secret_file = auth.write_secret_file(str(tmp_path / "job.secret"))
    store = control.ControlStore(master, auth.Signer(auth.read_secret_file(secret_file), "job-s"))
    store.publish_job("job-s")
    yield SimpleNamespace(store=store, stranger=stranger, secret_file=secret_file, port=master.port)


def report(store, wid, seconds, steps=range(4), stage=0):
    from hotspare import control

    store.report_compute(wid, control.Compute(stage, [{"step": s, "seconds": seconds} for s in steps]))


def test_the_coordinator_asks_a_straggler_to_hand_over_only_when_a_spare_can_take_it(plane):
    from hotspare import control

    now, said = [0.0], []
    watch = stragglers.StragglerWatch(plane.store, lambda: now[0], said.append)
    plan = control.Plan(0, 4, {str(r): f"a{r}" for r in range(4)})
    for r in range(4):
        report(plane.store, f"a{r}", 0.3 if r == 2 else 0.1)
    watch.look(plan, lambda rank: True)
    assert plane.store.handovers(0)[0] == []  # the job did not ask for stragglers (no policy published)
    plane.store.publish_stragglers(control.StragglerPolicy(factor=2.0, window=3))
    now[0] += stragglers.LOOK_S
    watch.look(plan, lambda rank: False)  # no spare can take rank 2: said once, nothing asked
    now[0] += stragglers.LOOK_S
    watch.look(plan, lambda rank: False)
    assert plane.store.handovers(0)[0] == [] and len(said) == 1 and "no ready spare" in said[0]
    now[0] += stragglers.LOOK_S
    watch.look(plan, lambda rank: True)
    [order] = plane.store.handovers(0)[0]
    assert (order.worker, order.rank, order.cause) == ("a2", 2, "straggler") and "3.0x" in order.detail
    now[0] += stragglers.LOOK_S
    watch.look(plan, lambda rank: True)  # one at a time: a2 is still in the plan
    assert len(plane.store.handovers(0)[0]) == 1


def test_the_steps_of_a_spares_start_and_of_a_recovery_do_not_count(plane):
    """A successor spare's imports and model build compete for its node's CPUs: on 2 cores a
    healthy rank looked 2.2x slower for 3 steps while one started, and was handed over. While a
    spare starts, and after a new generation, the steps so far are set aside: a straggler needs
    ``window`` fresh slow steps."""
    from hotspare import control

    now = [0.0]
    watch = stragglers.StragglerWatch(plane.store, lambda: now[0], lambda line: None)
    plane.store.publish_stragglers(control.StragglerPolicy(factor=2.0, window=3))
    plan = control.Plan(0, 4, {str(r): f"a{r}" for r in range(4)})

    def look(settling=False, plan=plan):
        now[0] += stragglers.LOOK_S
        watch.look(plan, lambda rank: True, settling=lambda: settling)
        return [o.worker for o in plane.store.handovers(0)[0]]

    for r in range(4):  # rank 2 slow in steps 0-3, while a spare starts
        report(plane.store, f"a{r}", 0.3 if r == 2 else 0.1)
    assert look(settling=True) == []
    for r in range(4):  # healthy again, two more steps: nothing fresh is slow
        report(plane.store, f"a{r}", 0.1, steps=range(4, 6))
    assert look() == [] and look() == []
    for r in range(4):  # slow for real now: three fresh steps
        report(plane.store, f"a{r}", 0.3 if r == 2 else 0.1, steps=range(6, 9))
    assert look() == ["a2"]


def test_a_starting_spare_counts_until_it_is_ready_or_for_at_most_its_bound(plane):
    from hotspare import control
    from hotspare.spares import STARTING_S, Spares

    spares = Spares(plane.store, {0, 1}, set, lambda line: None)
    assert not spares.starting(0.0)
    spares.add([control.Spare("s1.1", 1)])
    assert spares.starting(0.0) and spares.starting(STARTING_S - 1)
    assert not spares.starting(STARTING_S + 1)  # not waited for any longer
    spares.add([control.Spare("s0.1", 0)])
    assert spares.starting(STARTING_S + 1)
    plane.store.set_ready("s0.1", control.SPARE_ANY)
    assert not spares.starting(STARTING_S + 2)


def test_a_strangers_compute_times_and_policy_are_not_read(plane):
    from hotspare import control

    now = [0.0]
    watch = stragglers.StragglerWatch(plane.store, lambda: now[0], lambda line: None)
    plan = control.Plan(0, 4, {str(r): f"a{r}" for r in range(4)})
    plane.stranger.set(control.keys.STRAGGLERS, '{"factor": 1.1, "window": 2}')
    for r in range(4):
        plane.stranger.set(control.keys.compute(f"a{r}"), control.messages.to_json(
            control.Compute(0, [{"step": s, "seconds": 9.0 if r == 0 else 0.1} for s in range(4)])))
    watch.look(plan, lambda rank: True)
    assert watch.policy is None and plane.store.handovers(0)[0] == []
    plane.store.publish_stragglers(control.StragglerPolicy(factor=2.0, window=3))
    now[0] += stragglers.LOOK_S
    watch.look(plan, lambda rank: True)
    assert watch.policy is not None and plane.store.handovers(0)[0] == []  # unsigned times: nobody is slow
    report(plane.store, "a1", 9.0)
    for r in (0, 2, 3):
        report(plane.store, f"a{r}", 0.1)
    now[0] += stragglers.LOOK_S
    watch.look(plan, lambda rank: True)
    assert [o.worker for o in plane.store.handovers(0)[0]] == ["a1"]  # the job's own times are


def test_a_strangers_handover_and_drain_orders_are_never_read(plane):
    """Moving a rank is an action: only the job's signed entries count (control/lists.py)."""
    from hotspare import control

    order = control.messages.to_json(control.Handover("a1", 1, "drain", "forged"))
    for count, prefix, value in ((control.keys.HANDOVER_COUNT, control.keys.HANDOVER, order),
                                 (control.keys.DRAIN_COUNT, control.keys.DRAIN, '{"node": 1}')):
        plane.stranger.add(count, 1)
        plane.stranger.set(f"{prefix}0", value)
        plane.stranger.set(f"{prefix}1", value)
    plane.stranger.set(control.keys.drained(1), "1")
    assert plane.store.handovers(0)[0] == [] and plane.store.drains(0)[0] == []
    assert not plane.store.drained(1)
    plane.store.ask_drain(1)
    assert [d.node for d in plane.store.drains(0)[0]] == [1]


def test_the_drain_command_is_refused_without_the_jobs_secret_or_with_bad_flags(plane, tmp_path, capfd):
    from hotspare.launch import draining

    def drain(*flags):
        code = draining.main(["--master-port", str(plane.port), *flags])
        return code, capfd.readouterr().err.strip().splitlines()[-1]

    from hotspare.control import auth

    mine, theirs = plane.secret_file, auth.write_secret_file(str(tmp_path / "theirs"))
    code, last = drain("--job-secret-file", str(theirs), "--node", "1", "--wait-s", "0")
    assert code == 2 and "not signed" in last and plane.store.drains(0)[0] == []
    code, last = drain("--job-secret-file", str(mine), "--node", "-1")
    assert code == 2 and "--node -1 must be >= 0" in last
    code, last = drain("--job-secret-file", str(mine), "--node", "1", "--wait-s", "0")
    assert code == 0 and "drain of node 1 asked" in last
    assert [d.node for d in plane.store.drains(0)[0]] == [1]
    code, last = drain("--job-secret-file", str(mine), "--rank", "-3")
    assert code == 2 and "--rank -3 must be >= 0" in last
    code, last = drain("--job-secret-file", str(mine), "--rank", "1", "--node", "1")
    assert code == 2  # one or the other


def test_a_drained_rank_is_asked_to_hand_over_once_a_spare_can_take_it_and_its_move_is_said(plane, capfd):
    """``hotspare-run drain --rank R``: the coordinator asks R's worker to hand over (cause
    'drain') only when a spare can take it, one move at a time with a node's drain; once the plan
    shows R in another worker, ``moved/<R>`` says which, and the command returns it. A rank the
    job does not have is refused, said in ``moved/<R>``."""
    import threading
    import time

    from hotspare import control
    from hotspare.drain import Drains
    from hotspare.launch import draining

    said = []
    drains = Drains(plane.store, lambda wid: 0 if wid in ("a0", "a1") else 1, said.append)
    plan = control.Plan(0, 4, {str(r): f"a{r}" for r in range(4)})
    plane.store.ask_drain(rank=9)
    drains.look(plan, lambda rank: True)
    assert plane.store.moved(9) == "refused: the job has ranks 0..3"
    result = {}
    command = threading.Thread(target=lambda: result.update(code=draining.main(
        ["--master-port", str(plane.port), "--job-secret-file", str(plane.secret_file), "--rank", "2",
         "--wait-s", "30"])))
    command.start()
    while len(plane.store.drains(0)[0]) < 2:
        assert command.is_alive()
        time.sleep(0.01)
    drains.look(plan, lambda rank: False)  # no spare yet: asked of nobody, said once
    drains.look(plan, lambda rank: False)
    assert plane.store.handovers(0)[0] == [] and sum("no ready spare can take rank 2" in s for s in said) == 1
    drains.look(plan, lambda rank: True)
    drains.look(plan, lambda rank: True)  # asked once
    [order] = plane.store.handovers(0)[0]
    assert (order.worker, order.rank, order.cause) == ("a2", 2, "drain")
    drains.look(control.Plan(1, 4, {**plan.workers, "2": "s1.0"}, replaced={"2": "s1.0"}), lambda rank: True)
    command.join(timeout=30)
    assert plane.store.moved(2) == "moved to s1.0" and result == {"code": 0}
    assert "rank 2: moved to s1.0" in capfd.readouterr().err.strip().splitlines()[-1]
    assert not drains.ranks and len(plane.store.handovers(0)[0]) == 1


def test_a_recovery_between_a_handover_order_and_the_step_boundary_voids_it_and_the_order_is_given_again(
        plane, monkeypatch, capfd):
    """Issue 30's race: a real failure may take the spare a handover counted on between the order
    and the rank's step boundary. An order stands in its generation only: the worker, once the
    recovery moved it to the next generation, does not leave (nothing happens but a log line);
    the coordinator asks again in the new generation, and the launcher signals again."""
    import signal
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    import torch

    from hotspare import control
    from hotspare.generation import Generation
    from hotspare.launch.processes import Worker
    from hotspare.session.handover import Handover

    now = [0.0]
    watch = stragglers.StragglerWatch(plane.store, lambda: now[0], lambda line: None)
    plane.store.publish_stragglers(control.StragglerPolicy(factor=2.0, window=3))
    for r in range(4):
        report(plane.store, f"a{r}", 0.3 if r == 1 else 0.1)
    plan0 = control.Plan(0, 4, {str(r): f"a{r}" for r in range(4)})
    watch.look(plan0, lambda rank: True)
    [first] = plane.store.handovers(0)[0]
    assert (first.worker, first.generation) == ("a1", 0) and watch.asked == {"a1"}
    # Rank 3 fails and takes the spare (generation 1): a1 is still slow in the new generation's
    # steps, and is asked again once a spare can take it.
    plan1 = control.Plan(1, 4, {**plan0.workers, "3": "s1.0"}, replaced={"3": "s1.0"})
    now[0] += stragglers.LOOK_S
    watch.look(plan1, lambda rank: True)  # a recovery: the steps so far are set aside
    for r in range(4):
        report(plane.store, plan1.workers[str(r)], 0.3 if r == 1 else 0.1, steps=range(4, 8))
    now[0] += stragglers.LOOK_S
    watch.look(plan1, lambda rank: False)
    assert len(plane.store.handovers(0)[0]) == 1
    now[0] += stragglers.LOOK_S
    watch.look(plan1, lambda rank: True)
    now[0] += stragglers.LOOK_S
    watch.look(plan1, lambda rank: True)  # one order per generation
    assert [(o.worker, o.generation) for o in plane.store.handovers(0)[0]] == [("a1", 0), ("a1", 1)]

    # The worker: its launcher's signal came for generation 0's order; the recovery moved it on.
    monkeypatch.setenv("HOTSPARE_WORKER_ID", "a1")
    control_store = plane.store
    session = SimpleNamespace(config=None, heartbeat=None, store=control_store.raw, control=control_store,
                              generation=Generation(2, 1, 4))
    retired = []
    model = torch.nn.Linear(2, 2)
    handover = Handover(session, [], None, entry=[model])
    monkeypatch.setattr(handover, "retire", lambda: retired.append(session.generation.index))
    # Its newest order is generation 1's, and another recovery came since: void.
    handover.requested.set()
    handover.after_step(7)
    model(torch.zeros(2))
    assert retired == [] and not handover.requested.is_set() and not handover.armed
    assert "the order is void and this rank stays" in capfd.readouterr().err
    session.generation = Generation(1, 1, 4)  # generation 1's order stands: it leaves at the next step's forward
    handover.requested.set()
    handover.after_step(8)
    assert handover.armed and retired == []
    with torch.no_grad():
        model(torch.zeros(2))  # an evaluation: not a step
    assert retired == []
    model(torch.zeros(2))
    assert retired == [1]
    # Asked during the job's last step: the loop ends (steps() disarms), and a forward after it does not leave.
    handover.armed = False
    handover.requested.set()
    handover.after_step(9)
    handover.disarm()
    model(torch.zeros(2))
    assert retired == [1]
    # Asked in the generation this rank is about to join (the coordinator planned it first): kept.
    handover.armed = False
    session.generation = Generation(0, 1, 4)
    handover.requested.set()
    handover.after_step(10)
    assert not handover.armed and handover.requested.is_set()
    session.generation = Generation(1, 1, 4)
    handover.after_step(11)
    assert handover.armed
    handover.disarm()
    # A recovery before the next forward voids an armed order too.
    handover.requested.set()
    handover.after_step(10)
    handover.interrupted()
    model(torch.zeros(2))
    assert retired == [1]
    handover.close()

    # The launcher carries out an order once per generation, and a later generation's again.
    sleeper = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                f"signal.signal({int(control.HANDOVER_SIGNAL)}, lambda *a: print('got', flush=True))\n"
                                "signal.signal(signal.SIGUSR1, lambda *a: print('end', flush=True))\n"
                                "print('ready', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "ready"
        worker = Worker("a1", 0, sleeper, rank=1)
        orders = plane.store.handovers(0)[0]
        for order in orders:  # generation 0's, then generation 1's: a signal each
            worker.hand_over(order)
            assert sleeper.stdout.readline().strip() == "got"
        for order in orders:  # given again: nothing more is sent
            worker.hand_over(order)
        time.sleep(0.2)
        sleeper.send_signal(signal.SIGUSR1)
        assert sleeper.stdout.readline().strip() == "end" and worker.handing_over
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
