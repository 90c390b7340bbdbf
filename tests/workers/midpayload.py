"""Worker for tests/test_recovery_pieces.py: rank 0 sends one large tensor to rank 1; once the
bytes move, rank 1 shuts down its connections with ``break_connections(drain_s=...)``.
drain_s 0 cuts the payload (gloo then wakes neither end before the group's timeout); the
default lets it land, and the next receive fails at once. Prints one JSON line per rank."""
from __future__ import annotations

import datetime
import json
import os
import sys
import termios
import threading
import time

import torch
import torch.distributed as dist

from hotspare.sockets import break_connections, _connections, _queued

NUMEL = 64 * 1024 * 1024  # 256 MB of float32: ~0.1 s on the wire here, so the break lands mid-payload


def main(rank: int, port: int, drain_s: float, timeout_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    x = torch.arange(NUMEL, dtype=torch.float32) if rank == 0 else torch.zeros(NUMEL)
    dist.barrier()
    out = {"rank": rank}
    if rank == 1:
        def breaker():
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # until the payload's bytes arrive
                socks = _connections({port})
                busy = any(_queued(s, termios.FIONREAD) > 0 for s in socks)
                for s in socks:
                    s.close()
                if busy:
                    break
                time.sleep(0.0005)
            out["moving_seen"] = busy
            out["broken"] = break_connections({port}, drain_s=drain_s)

        t = threading.Thread(target=breaker)
        t.start()
    t0, phase = time.monotonic(), "first"
    try:
        (dist.isend(x, 1) if rank == 0 else dist.irecv(x, 0)).wait()
        out["first"] = "ok"
        out["first_s"] = time.monotonic() - t0
        if rank == 1:
            out["intact"] = bool(torch.equal(x[-5:], torch.arange(NUMEL - 5, NUMEL, dtype=torch.float32)))
            t.join()
            phase, t0 = "second", time.monotonic()
            dist.irecv(x[:1], 0).wait()  # never sent: only the broken connection ends it
            out["second"] = "ok"
    except RuntimeError as e:
        out[phase], out["error"] = "error", str(e)[:300]
        out[f"{phase}_s"] = time.monotonic() - t0
    if rank == 1:
        t.join()
    print(json.dumps(out), flush=True)
    # Neither exits before the other is done: an exit closes the pairs, and that would wake the
    # other end's wait (CI saw rank 0's exit at its own timeout end rank 1's wait just before its).
    try:
        store.set(f"done/{rank}", "1")
        store.wait([f"done/{1 - rank}"], datetime.timedelta(seconds=30))
    finally:  # (rank 0, the store's server, may be gone already: exit all the same, never via the destructors)
        os._exit(0)  # the groups' destructors would wait on the broken pairs


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
