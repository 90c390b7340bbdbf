"""A mirror transfer interrupted midway by the sender's death (SIGKILL, real processes, gloo,
127.0.0.1) never becomes committed, and the previous committed version stays intact."""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys

import torch.distributed as dist

WORKER = os.path.join(os.path.dirname(__file__), "workers", "mirror_kill.py")


def test_sender_killed_mid_transfer_never_commits(tmp_path, no_leaks):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    out = tmp_path / "rank1.json"
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, WORKER, str(out)], env=env))
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [-signal.SIGKILL, 0], codes  # the fault fired, and the survivor finished
    r = json.loads(out.read_text())
    # It failed on the payload (tag 72), after the header and some chunks had arrived.
    assert "mirroring stopped" in r["error"] and "tag 72" in r["error"], r["error"]
    assert r["committed_version"] == 1, "a partial transfer became committed"
    assert r["committed_digest"] == r["expected_v1_digest"] != r["v2_digest"]
    assert r["own_v1_kept"]
    assert r["short_message_lands_at_start"], "gloo no longer lands a short message in a longer buffer (mirror.py's first message)"
