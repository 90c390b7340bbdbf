"""Worker for tests/test_mirror_kill.py: two real ranks mirror each other over gloo; rank 0
SIGKILLs itself part-way through sending version 2. Rank 1 writes what it holds afterwards."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from hotspare.mirror import Mirror, MirrorError
from hotspare.transport import GlooTransport

NUMEL = 2 << 20  # 8 MiB of fp32 per snapshot, sent in 64 KiB chunks: a transfer in many pieces


def state(rank: int, version: int):
    g = torch.Generator().manual_seed(100 * rank + version)
    return [("fp32.0", torch.randn(NUMEL, generator=g)), ("optim.0.step", torch.tensor([float(version)]))]


def digest(views) -> str:
    h = hashlib.sha256()
    for v in views:
        h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("gen/0/", store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    data, control = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    # What the mirror's first message relies on: gloo lands a message shorter than the buffer
    # posted for it at the buffer's start (the header that leads it says how long it was).
    short_ok = True
    if rank == 0:
        dist.isend(torch.arange(100, dtype=torch.uint8), dst=1, group=data, tag=5).wait()
    else:
        landing = torch.full((1000,), 255, dtype=torch.uint8)
        dist.irecv(landing, src=0, group=data, tag=5).wait()
        short_ok = torch.equal(landing[:100], torch.arange(100, dtype=torch.uint8)) and bool((landing[100:] == 255).all())

    def agree(t):
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)

    mirror = Mirror(rank, 0, {0: [1], 1: [0]}, GlooTransport(data, rank), agree, chunk_bytes=64 << 10,
                    timeout_s=20)
    s1 = state(rank, 1)
    mirror.on_step(1, lambda: s1, lambda: {"version": 1})
    assert mirror.flush() == 1
    if rank == 0:
        real_send, handles = mirror.transport.send, []

        def send_then_die(tensor, dst, tag):
            if len(handles) == 40:
                # The first message (the header and the first chunk) and 20 more chunks (of 128)
                # have reached rank 1; die mid-transfer.
                for h in handles[:21]:
                    h.wait(20)
                os.kill(os.getpid(), signal.SIGKILL)
            handles.append(real_send(tensor, dst, tag))
            return handles[-1]

        mirror.transport.send = send_then_die
    s2 = state(rank, 2)
    mirror.on_step(2, lambda: s2, lambda: {"version": 2})
    error = ""
    try:
        mirror.flush(timeout_s=60)
    except MirrorError as exc:
        error = str(exc)
    version, buf = mirror.read_committed(0)
    result = {"error": error, "committed_version": version,
              "committed_digest": digest(mirror.layout.views(buf)),
              "expected_v1_digest": digest(t for _, t in state(0, 1)),
              "v2_digest": digest(t for _, t in state(0, 2)),
              "own_v1_kept": mirror.own_snapshot(1) is not None, "short_message_lands_at_start": short_ok}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    mirror.close()
    os._exit(0)  # the group has a dead member: skip the collective teardown


if __name__ == "__main__":
    main(sys.argv[1])
