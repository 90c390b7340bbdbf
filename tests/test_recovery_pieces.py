"""The small pieces of the worker-side recovery, in one process: breaking the failed
generation's connections, telling a peer's failure from a bug, and the Python-level
rendezvous of a new generation."""
from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

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
            n = break_connections({store.getsockname()[1]})
            # Both ends of the peer connection live in this process: both were shut down.
            assert n >= 2
            assert peer_server.recv(1) == b""  # EOF at once, not a timeout
            store_client.sendall(b"x")
            assert store_server.recv(1) == b"x"  # the control store's connection is untouched
        finally:
            for s in (peer_client, peer_server, store_client, store_server):
                s.close()


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
