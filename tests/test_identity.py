"""hotspare.identity and the start-up refusals of the control plane, in one process with a real
TCPStore on 127.0.0.1: a process of another job is refused at every join, a worker running
another script, config or version is refused naming both fingerprints, an unreachable store is
named with what to check, and another DeepSpeed or megatron-core version is refused."""
from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from hotspare import control, env, identity
from hotspare.control import auth
from hotspare.generation import Generation, connect_store, join
from hotspare.launch import interface_of, listen_socket, route_to


@pytest.fixture
def store(monkeypatch):
    """A control store, and this process's environment: job job-a's secret."""
    listener = listen_socket("127.0.0.1", 0)
    master = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5), master_listen_fd=listener.fileno())
    listener.detach()
    monkeypatch.setenv(env.HOTSPARE_JOB_SECRET, SECRET.hex())
    monkeypatch.setenv(env.HOTSPARE_JOB_ID, "job-a")
    yield master


SECRET = auth.new_secret()


def test_a_process_of_another_job_is_refused_at_the_join(store, monkeypatch):
    control.ControlStore(store, auth.Signer(SECRET, "job-a")).publish_job("job-a")
    identity.check_job(store)  # its own job: fine
    monkeypatch.setenv(env.HOTSPARE_JOB_ID, "job-b")
    with pytest.raises(identity.JoinRefused, match="belongs to job job-b, but the control store .* serves job job-a"):
        join(store, Generation(0, 0, 1), "gloo", 5.0)
    assert not dist.is_initialized()


def test_a_process_without_the_jobs_secret_is_refused_at_the_join(store, monkeypatch):
    monkeypatch.setattr(identity, "CHECK_WAIT_S", 0.2)
    control.ControlStore(store, auth.Signer(SECRET, "job-a")).publish_job("job-a")
    monkeypatch.setenv(env.HOTSPARE_JOB_SECRET, auth.new_secret().hex())
    with pytest.raises(identity.JoinRefused, match="not signed with this process's job secret"):
        join(store, Generation(0, 0, 1), "gloo", 5.0)
    monkeypatch.delenv(env.HOTSPARE_JOB_SECRET)
    with pytest.raises(identity.JoinRefused, match="HOTSPARE_JOB_SECRET is not set"):
        identity.check_job(store)
    assert not dist.is_initialized()


def test_a_job_id_or_fingerprint_a_stranger_wrote_over_is_put_back_and_a_joiner_waits_for_it(store, monkeypatch):
    """A stranger overwrites job/id and job/fingerprint: node 0's launcher puts the job's back
    (naming each key once), a process that joins meanwhile looks again instead of being refused,
    and a process that checked its job once does not read job/id again at later joins (a forged
    id there once stopped every rank's recovery)."""
    import threading

    node0 = control.ControlStore(store, auth.Signer(SECRET, "job-a"))
    node0.publish_job("job-a")
    identity.check_fingerprint(store, "f00d", "a0")
    known = node0.guard_identity("job-a", None)
    assert known == "f00d"
    store.set(control.keys.JOB_ID, "hs1." + "0" * 64 + ".job-a")
    store.set(control.keys.FINGERPRINT, "forged")
    monkeypatch.setenv(env.HOTSPARE_JOB_ID, "job-c")  # a process that has not checked yet
    def after_a_put_back(check):
        put_back = threading.Timer(0.5, lambda: node0.guard_identity("job-a", known))
        put_back.start()
        try:
            check()
        finally:
            put_back.join()

    with pytest.raises(identity.JoinRefused, match="belongs to job job-c"):  # waited, then read the real id
        after_a_put_back(lambda: identity.check_job(store))
    monkeypatch.setenv(env.HOTSPARE_JOB_ID, "job-a")
    store.set(control.keys.FINGERPRINT, "forged")
    after_a_put_back(lambda: identity.check_fingerprint(store, "f00d", "s0.0"))  # waited: not refused
    identity.check_job(store)
    store.set(control.keys.JOB_ID, "forged")
    identity.check_job(store)  # checked once: not read again
    assert node0.guard_identity("job-a", known) == "f00d" and node0.job_id() == "job-a"


def test_a_worker_that_runs_something_else_is_refused_naming_both_fingerprints(store, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    config = {"zero_optimization": {"stage": 2}, "hotspare": {"mirror": {"replicas": 1}}}
    job = identity.fingerprint(config, {"deepspeed": "0.19.8"}, script=str(script))
    assert job == identity.fingerprint(dict(reversed(list(config.items()))), {"deepspeed": "0.19.8"},
                                       script=str(script))  # key order does not matter
    others = [identity.fingerprint({**config, "zero_optimization": {"stage": 3}}, {"deepspeed": "0.19.8"},
                                   script=str(script)),
              identity.fingerprint(config, {"deepspeed": "0.19.9"}, script=str(script))]
    script.write_text("print('train, edited')\n")
    others.append(identity.fingerprint(config, {"deepspeed": "0.19.8"}, script=str(script)))
    assert len({job, *others}) == 4
    identity.check_fingerprint(store, job, "a0")
    identity.check_fingerprint(store, job, "a1")
    for other in others:
        with pytest.raises(identity.JoinRefused, match=f"worker s0.0 runs a different .*fingerprint {other}, the "
                                                        f"job's {job}"):
            identity.check_fingerprint(store, other, "s0.0")


def test_an_unreachable_store_is_named_with_what_to_check():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"cannot reach hotspare's control store at 127.0.0.1:{port}"):
        connect_store("127.0.0.1", port, 1.0)


def test_the_advertised_address_and_its_interface():
    assert route_to("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.1") == ""  # TEST-NET-1: no local interface has it


def test_another_deepspeed_or_megatron_core_version_is_refused(monkeypatch):
    import deepspeed
    from megatron.core import package_info

    from hotspare.integrations import deepspeed as ds_integration
    from hotspare.integrations import megatron as mc_integration

    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(RuntimeError, match="0.20.1"):
        ds_integration.check_version()
    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match="0.17.0 is installed"):
        mc_integration.check_version()
