"""Worker for tests/test_recovery_pieces.py: rank 0 posts a receive from rank 1; once it is
posted, rank 1 shuts its connections down and then sends. ``cut`` shuts both sides of each
connection at once (SHUT_RDWR); ``break`` uses ``break_connections`` (reading side first).
Prints one JSON line per rank: how its operation ended and how long it took."""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from hotspare.sockets import _connections, break_connections


def main(rank: int, port: int, mode: str, timeout_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    x = torch.zeros(1000)
    dist.barrier()
    out = {"rank": rank, "mode": mode}
    t0 = time.monotonic()
    try:
        if rank == 0:
            work = dist.irecv(x, 1)
            store.set("posted", "1")
        else:
            store.wait(["posted"])
            time.sleep(0.3)  # the receive's ready note reaches rank 1: its send is written at once
            if mode == "cut":
                for sock in _connections({port}):
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
            else:
                break_connections({port})
            t0 = time.monotonic()
            work = dist.isend(x, 0)
        work.wait()
        out["end"] = "ok"
    except RuntimeError as e:
        out["end"], out["error"] = "error", str(e)[:300]
    out["s"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
    try:  # neither exits before the other is done (an exit would wake the other's wait)
        store.set(f"done/{rank}", "1")
        store.wait([f"done/{1 - rank}"], datetime.timedelta(seconds=30))
    finally:
        os._exit(0)  # the groups' destructors would wait on the broken pairs


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
