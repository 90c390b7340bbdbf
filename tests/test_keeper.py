"""The keeper as a process (hotspare.keeper): started by hotspare-run or on its own, answering
over its Unix socket, and leaving nothing in /dev/shm whether it is stopped, its launcher is
SIGKILLed, or it is SIGKILLed itself and a new keeper starts on the node. Needs /dev/shm."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from hotspare import keeper
from hotspare.keeper import KeeperError
from hotspare.keeper_client import KeeperClient

pytestmark = pytest.mark.skipif(not os.path.isdir(keeper.SHM_DIR), reason="needs /dev/shm")


def ours(job: str) -> list[str]:
    return sorted(n for n in os.listdir(keeper.SHM_DIR) if n.startswith(f"hotspare-{job}-"))


def test_a_keeper_serves_segments_and_removes_them_when_stopped(tmp_path, no_leaks, capfd):
    job = f"t{os.getpid()}a"
    sock = str(tmp_path / "k.sock")
    proc = keeper.start(job, 0, sock)
    try:
        client = KeeperClient(sock)
        seg, note, device = client.open(1, layout_id=9, nbytes=10000, chunk_bytes=4096)
        assert note == "" and seg.rank == 1 and len(ours(job)) == 1 and device is None
        seg.slots[0][:4] = 7
        seg.seal(0, 3, 0)
        seg.commit(0, 3)
        seen, wire = client.lookup(1)  # another process on the node (a spare) sees the same bytes
        assert seen.complete_versions() == {3: 0} and int(seen.slots[0][2]) == 7 and wire is None
        assert client.lookup(0) == (None, None)
        assert client.stats()["bytes"] > 20000
        seg.close()
        seen.close()
        # The same layout again: the same segment. A new one (the first step made the optimizer's
        # state): the old segment is replaced, and the log says by how much it grew.
        again, _, _ = client.open(1, layout_id=9, nbytes=10000, chunk_bytes=4096)
        assert again.complete_versions() == {3: 0}
        again.close()
        grown, _, _ = client.open(1, layout_id=10, nbytes=3 << 20, chunk_bytes=4096)
        assert grown.complete_versions() == {} and len(ours(job)) == 1
        grown.close()
        assert "rank 1's state changed layout, 0.01 -> 3.00 MiB (as when the first step makes the optimizer's " \
               "state): its retained segment is replaced" in capfd.readouterr().err
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0 and ours(job) == [] and not os.path.exists(sock)
    with pytest.raises(KeeperError, match="did not answer"):
        KeeperClient(sock, timeout_s=1.0).stats()
    # A rank whose state changes layout after its keeper died (it was killed at the first step)
    # trains on with private snapshots, and says so: it once failed the step and stopped the job.
    from hotspare.slots import PrivateSnapshots
    from hotspare.snapshot import Layout

    notes = []
    make = KeeperClient(sock, timeout_s=1.0).snapshots_for(1, 4096, 0, notes.append)
    assert isinstance(make(Layout([("w", torch.float32, 16)])), PrivateSnapshots)
    assert "did not answer" in notes[0] and "stay in its own memory" in notes[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the keeper's answer where there is no GPU")
def test_a_device_tier_the_keeper_cannot_serve_leaves_the_host_tier_and_says_why(tmp_path, no_leaks):
    job = f"t{os.getpid()}d"
    sock = str(tmp_path / "k.sock")
    proc = keeper.start(job, 0, sock)
    try:
        seg, note, device = KeeperClient(sock, timeout_s=60).open(0, layout_id=9, nbytes=10000, chunk_bytes=4096,
                                                                 device=0)
        assert seg is not None and device is None
        assert "cannot be retained on GPU 0" in note and "retain.device_tier" in note
        seg.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert ours(job) == []


def test_a_killed_keeper_leaves_segments_that_the_next_keeper_removes(tmp_path, no_leaks):
    job = f"t{os.getpid()}b"
    first = keeper.start(job, 0, str(tmp_path / "1.sock"))
    KeeperClient(str(tmp_path / "1.sock")).open(0, 1, 5000, 4096)[0].close()
    first.kill()
    first.wait()
    assert len(ours(job)) == 1
    second = keeper.start(f"{job}x", 0, str(tmp_path / "2.sock"))  # another job's keeper on the node
    try:
        assert ours(job) == []
    finally:
        second.terminate()
        second.wait(timeout=10)


def test_a_keeper_whose_launcher_is_killed_cleans_up_by_itself(tmp_path, no_leaks):
    job = f"t{os.getpid()}c"
    sock = str(tmp_path / "k.sock")
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from hotspare import keeper, keeper_client
        keeper.start({job!r}, 0, {sock!r})
        keeper_client.KeeperClient({sock!r}).open(0, 1, 5000, 4096)
        print("up", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "up"
    (child,) = psutil.Process(parent.pid).children()
    assert len(ours(job)) == 1
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    child.wait(timeout=10)
    assert ours(job) == [] and not os.path.exists(sock)
