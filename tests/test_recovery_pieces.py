"""The small pieces of the worker-side recovery, in one process: breaking the failed
generation's connections, telling a peer's failure from a bug, and the Python-level
rendezvous of a new generation."""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time

import pytest
import torch.distributed as dist

from hotspare import sockets
from hotspare.generation import Generation, arrive
from hotspare.mirror import MirrorError
from hotspare.recovery import is_distributed_error
from hotspare.sockets import break_connections


def _pair(listener):
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    server.settimeout(5)
    return client, server


def test_breaking_connections_gives_the_peer_eof_and_spares_the_store():
    with socket.create_server(("127.0.0.1", 0)) as a, socket.create_server(("127.0.0.1", 0)) as store:
        peer_client, peer_server = _pair(a)
        store_client, store_server = _pair(store)
        try:
            n = break_connections({store.getsockname()[1]}).count
            # Both ends of the peer connection live in this process: both were shut down.
            assert n >= 2
            assert peer_server.recv(1) == b""  # EOF at once, not a timeout
            store_client.sendall(b"x")
            assert store_server.recv(1) == b"x"  # the control store's connection is untouched
        finally:
            for s in (peer_client, peer_server, store_client, store_server):
                s.close()


STREAM = """import socket, sys, threading
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
n = 0
try:
    while not stop.is_set():  # until told (or its stdin closes)
        s.sendall(b"y" * 65536)
        n += 65536
except OSError:
    n = -1  # cut mid-payload
print(n)
"""


def until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Return once ``condition()`` holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.001)


def test_a_connection_moving_a_payload_is_shut_down_once_it_drained(monkeypatch):
    """``moving``: bytes queued, or data in the last QUIET_MS. The break waits for such a
    connection (here a payload streamed by another process, told to stop once the break found
    it moving: every byte arrives), and cuts one that stalled (nobody reads it) after STALL_MS,
    not at drain_s."""
    import subprocess

    with socket.create_server(("127.0.0.1", 0)) as listener:
        idle_a, idle_b = _pair(listener)
        stuck_sender, stuck_reader = _pair(listener)
        sender = subprocess.Popen([sys.executable, "-c", STREAM, str(listener.getsockname()[1])],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        reader, _ = listener.accept()
        got = []
        try:
            # Quiet once QUIET_MS passed without data (the kernel counts the handshake as data received).
            until(lambda: not sockets.moving(idle_a) and not sockets.moving(idle_b), "idle connections quiet")
            stuck_sender.sendall(b"x" * 100_000)  # never read
            assert sockets.moving(stuck_reader)

            def read():
                while chunk := reader.recv(1 << 20):
                    got.append(len(chunk))

            thread = threading.Thread(target=read)
            thread.start()
            until(lambda: got, "the payload on the wire", timeout_s=30)
            moving, seen = sockets.moving, []

            def watched(sock):  # the sender streams until the break found its connection moving
                now = moving(sock)
                if now and not seen and sock.getpeername() == reader.getpeername():
                    seen.append(True)
                    sender.stdin.write("stop\n")
                    sender.stdin.flush()
                return now

            monkeypatch.setattr(sockets, "moving", watched)
            broken = break_connections({-1}, drain_s=5.0)
            thread.join(timeout=5)
            stdout, _ = sender.communicate(timeout=30)
            assert seen and broken.count >= 5
            # The payload was not cut: every byte arrived. The stalled pair did not hold the break
            # up to the drain's end: nothing was still moving when cut.
            assert int(stdout) == sum(got) > 0 and broken.forced == 0, broken
        finally:
            sender.kill()
            for s in (idle_a, idle_b, stuck_sender, stuck_reader, reader):
                s.close()


def test_gloo_wakes_no_transfer_cut_mid_payload_and_the_break_lets_it_land():
    """Pins what sockets.py works around (torch 2.13's gloo): a send and a receive whose bytes
    were moving when the connection was shut down wait out the group's timeout on both ends.
    ``break_connections`` waits for the payload instead: it lands intact, and the next receive
    on the broken connection fails at once."""
    import subprocess

    worker = os.path.join(os.path.dirname(__file__), "workers", "midpayload.py")
    out = {}
    for drain in ("0", "5"):  # one pair at a time: a sender descheduled for QUIET_MS looks done
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        procs = [subprocess.Popen([sys.executable, worker, str(r), port, drain, "2"], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in (0, 1)]
        for r, p in enumerate(procs):
            stdout, _ = p.communicate(timeout=120)
            out[drain, r] = json.loads(stdout.strip().splitlines()[-1])
    for r in (0, 1):  # cut: both ends time out (gloo's own message), neither is told of the broken connection
        assert out["0", r]["first"] == "error" and "Timed out" in out["0", r]["error"], out["0", r]
    assert out["0", 1]["moving_seen"] and out["0", 1]["broken"][1] >= 1  # cut while moving: forced
    assert out["5", 1]["broken"][1] == 0
    assert out["5", 0]["first"] == "ok" and out["5", 1]["first"] == "ok" and out["5", 1]["intact"], out
    # The next receive fails on the broken connection itself, not at the group's timeout.
    assert out["5", 1]["second"] == "error" and "Timed out" not in out["5", 1]["error"], out["5", 1]


def test_a_send_posted_just_after_the_break_fails_at_once_instead_of_at_the_timeout():
    """Issue 32's stuck tensor-parallel survivor. Pins torch 2.13's gloo: a send written at once
    (its peer's receive already posted) into a connection whose writing side was just shut, and
    whose end of file gloo reads only after it (the old break's race, made certain here: the
    receiver is stopped, the reading side shut after the send), waits out the group's timeout.
    ``break_connections`` shuts the reading side first and the writing side once gloo closed the
    pair: the same send fails at once (tests/workers/sendafterbreak.py)."""
    import subprocess

    worker = os.path.join(os.path.dirname(__file__), "workers", "sendafterbreak.py")
    procs = {}
    for mode in ("cut", "break"):  # two independent pairs, side by side
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        procs[mode] = [subprocess.Popen([sys.executable, worker, str(r), port, mode, "3"], stdout=subprocess.PIPE,
                                        text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in (0, 1)]
    out = {}
    for mode, pair in procs.items():
        for r, p in enumerate(pair):
            stdout, _ = p.communicate(timeout=120)
            out[mode, r] = json.loads(stdout.strip().splitlines()[-1])
    for mode in ("cut", "break"):  # the receiver is told at once either way
        assert out[mode, 0]["end"] == "error" and "Timed out" not in out[mode, 0]["error"], out[mode, 0]
    assert out["cut", 1]["end"] == "error" and "Timed out" in out["cut", 1]["error"], out["cut", 1]
    assert out["break", 1]["end"] == "error" and "Timed out" not in out["break", 1]["error"], out["break", 1]
    assert out["break", 1]["s"] < 1.5, out["break", 1]


@pytest.mark.parametrize("exc, expected", [
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"), True),
    (RuntimeError("Read error [127.0.0.1]:53425: Connection reset by peer"), True),
    (MirrorError("rank 0: mirroring stopped"), True),
    (TimeoutError("waited 60 s"), True),
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"), False),
    (RuntimeError("the data loader's timeout elapsed"), False),
    (ValueError("bad batch"), False),
    (KeyError("loss"), False),
])
def test_a_peer_failure_is_told_from_a_bug(exc, expected):
    assert is_distributed_error(exc) is expected


def test_a_missing_member_of_a_new_generation_is_named():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    store.set("gen/3/arrived/0", "1")
    with pytest.raises(TimeoutError, match=r"generation 3: rank\(s\) \[2\] did not arrive within 0 s"):
        arrive(store, Generation(3, 1, 3), timeout_s=0.2)


def test_the_modules_a_spare_imports_while_it_waits_exist():
    """Pins LAZY_IMPORTS against the installed DeepSpeed: a moved module would silently put its
    import back on the recovery's critical path."""
    from hotspare.env import configure_accelerator

    configure_accelerator()
    from hotspare.integrations.deepspeed import warm_up_spare

    assert warm_up_spare() == []


def test_groups_created_without_a_timeout_get_the_configured_one():
    """DeepSpeed's new_group(ranks) passes no timeout: torch then reads the module default,
    which default_group_timeout sets for the duration of deepspeed.initialize."""
    import datetime
    import inspect

    from torch.distributed import distributed_c10d as c10d

    from hotspare.integrations.deepspeed import default_group_timeout

    before = c10d._get_default_timeout("gloo")
    with default_group_timeout(7.0):
        assert c10d._get_default_timeout("gloo") == datetime.timedelta(seconds=7)
    assert c10d._get_default_timeout("gloo") == before
    assert "_get_default_timeout(" in inspect.getsource(c10d._new_group_with_tag)
    import importlib

    from hotspare import env

    env.configure_accelerator()
    backend = importlib.import_module("deepspeed.comm.torch").TorchBackend
    assert "torch.distributed.new_group(ranks)" in inspect.getsource(backend.new_group)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_left_generations_groups_are_destroyed_by_the_reaper_once_nothing_else_holds_them():
    """leave(background=True) (a recovery) hands every group of the generation to a Reaper
    thread, which drops each once it holds the last reference: a gloo group's destructor waits
    ~10 ms for its threads, and left to the garbage collector it stalled the first iteration
    after a recovery. Pins torch's registry of groups (``_world.pg_map``) that it reads."""
    from torch.distributed import distributed_c10d as c10d

    from hotspare.generation import leave

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    before = _os_threads()  # (the store serves on a thread of its own)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    groups = [dist.new_group([0]) for _ in range(3)]
    assert all(g in c10d._world.pg_map for g in [dist.group.WORLD, *groups])
    assert _os_threads() > before  # each gloo group runs threads of its own
    held = groups[1]
    del groups
    reaper = leave(background=True)
    assert not dist.is_initialized() and reaper.ident is None  # the caller starts it (after its recovery)
    reaper.start()
    deadline = time.monotonic() + 10
    while reaper.destroyed < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reaper.destroyed == 3 and reaper.is_alive()  # the held one waits for its holder
    del held
    reaper.join(timeout=10)
    assert not reaper.is_alive() and (reaper.destroyed, reaper.left) == (4, 0)
    # Thread.join returns once the thread's Python part ended; its OS thread leaves
    # /proc/self/task a moment later (seen on a loaded machine).
    deadline = time.monotonic() + 5
    while _os_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _os_threads() <= before


def test_the_reaper_lets_go_of_a_group_still_held_when_its_wait_runs_out_or_it_is_finished():
    """A group someone keeps is not waited for forever: after wait_s, or at once when the session
    closes (finish), the reaper drops its own reference and ends."""
    from hotspare.generation import Reaper

    held = object()
    reaper = Reaper([held], wait_s=0.0)
    reaper.start()
    reaper.join(timeout=10)
    assert (reaper.destroyed, reaper.left) == (0, 1)
    assert sys.getrefcount(held) == 2  # this frame's and the call's: the reaper dropped its own
    reaper = Reaper([held], wait_s=600.0)
    reaper.start()
    assert reaper.finish(timeout_s=10) and (reaper.destroyed, reaper.left) == (0, 1)
    assert sys.getrefcount(held) == 2
    reaper = Reaper([held])  # never started (a recovery that failed): the session's close lets go
    assert reaper.finish() and reaper.left == 1 and sys.getrefcount(held) == 2


def test_an_alarm_that_comes_after_the_training_thread_began_leaving_is_dropped():
    """The alarm thread may pass its check, then run only once the training thread saw the
    failure on its own and began its recovery. Run then, it marked the next generation failed:
    that generation's first forward raised and a second, spurious recovery followed (seen on
    DeepSpeed in recipes/bench_recovery.py). Now it is dropped: no second leaving (break of the
    connections), and the next generation's forward goes on."""
    from hotspare.alarm import AlarmGuard
    from hotspare.recovery import GenerationFailed

    left = []
    alarm = AlarmGuard(left.append)
    alarm.raise_if_alarmed(0)  # not alarmed: goes on
    assert alarm.superseded(0) and left == [0]
    with pytest.raises(GenerationFailed, match="generation 0 failed"):
        alarm.raise_if_alarmed(0)
    alarm.begin_leaving(0)
    assert not alarm.superseded(0) and left == [0]  # late: the training thread answers it
    alarm.raise_if_alarmed(1)  # the next generation is not marked failed
    assert alarm.superseded(1) and left == [0, 1]
    with pytest.raises(GenerationFailed, match="generation 1 failed"):
        alarm.raise_if_alarmed(1)


def test_a_sessions_alarm_leaves_by_breaking_its_connections(monkeypatch):
    """The session's leaving on an alarm (gloo): every connection but the store's is broken."""
    from hotspare.session import core as session_mod
    from hotspare.generation import Generation
    from hotspare.session import Session

    broken = []
    monkeypatch.setattr(session_mod, "break_connections", lambda keep: broken.append(keep) or sockets.Broken(0, 0))
    s = Session(config=None, generation=Generation(0, 1, 2), store=None)
    assert s.alarm.superseded(0) and len(broken) == 1
    s.alarm.begin_leaving(0)
    assert not s.alarm.superseded(0) and len(broken) == 1


@pytest.mark.parametrize("failed_at, landed", [(5, 4), (5, 5), (-1, 3)], ids=["lost-1", "lost-0", "spare-at-rank-0"])
def test_caught_up_is_said_once_a_step_of_the_new_generation_completed_at_the_interrupted_step(failed_at, landed,
                                                                                               monkeypatch):
    """Rank 0 after a recovery writes ``caught_up/<g>`` (successors start; the coordinator counts
    the takeover as done) only once a step completed in the new generation and the count is
    back at the step the failure interrupted: not after a resilient call that stepped nothing
    (recipes make their fault hooks resilient too), and not one step late."""
    from hotspare.session import CatchUp, Session

    class Counted(Session):
        count = landed

        def step_count(self):
            return self.count

    from hotspare import control, env
    from hotspare.control import auth

    secret = auth.new_secret()
    monkeypatch.setenv(env.HOTSPARE_JOB_SECRET, secret.hex())  # as hotspare-run gives its workers
    monkeypatch.delenv(env.HOTSPARE_JOB_ID, raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    plane = control.ControlStore(store, auth.Signer(secret, ""))
    s = Counted(config=None, generation=Generation(2, 0, 4), store=store)
    s.catching_up = CatchUp(2, failed_at, landed)

    def step():
        s.count += 1

    said = []
    for _ in s.steps(landed + 3):
        s.resilient(lambda: None)()  # a hook made resilient: no step
        said.append(plane.caught_up(2))
        s.resilient(step)()
    first = landed + said.index(True)  # the count when it was first said
    assert first == max(failed_at, landed + 1), (first, said)
    assert plane.text(control.keys.caught_up(2)) == str(first) and s.catching_up is None


ABORT = """import datetime, torch, torch.distributed as dist
from hotspare import sockets
from hotspare.rebuild import find_groups
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
a, b = dist.new_group([0]), dist.new_group([0])
dist.get_backend = lambda group=None: "nccl"  # as on a GPU: every group is NCCL's
sockets.abort_nccl([a, b, a, None, dist.group.WORLD])
print(sorted(dist.get_process_group_ranks(g)[0] for g in (a, b)), len(find_groups([{"a": a, "b": b}])))
"""


def test_aborting_nccl_groups_leaves_them_registered_for_the_rebuild():
    """torch's ``_abort_process_group`` unregisters a group, so the rebuild's walk (which asks a
    group's ranks) raised KeyError on every NCCL survivor the alarm had reached. ``abort_nccl``
    aborts each group's communicators and leaves them registered (torch 2.13; gloo stands in
    for NCCL here, whose groups abort the same way)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", ABORT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[0,", "0]", "2"], proc.stdout
