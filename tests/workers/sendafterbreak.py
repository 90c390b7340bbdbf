"""Worker for tests/test_recovery_pieces.py: rank 0 posts a receive from rank 1 and stops
itself (SIGSTOP: its gloo loop cannot answer what follows; the store lives in rank 1). Rank 1
then shuts its connections down and sends, and continues rank 0 once its send ended.
``cut`` is the old order, both sides at once, with the send posted in between (SHUT_WR, the
send, SHUT_RD: what a send posted between the old break's shutdown and gloo's reading of the
end of file met); ``break`` is ``break_connections`` (reading side first) and then the send.
Prints one JSON line per rank: how its operation ended and how long it took."""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

from hotspare.sockets import _connections, break_connections


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def main(rank: int, port: int, mode: str, timeout_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 1, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    x = torch.zeros(1000)
    dist.barrier()
    out, peer = {"rank": rank, "mode": mode}, None
    t0 = time.monotonic()
    try:
        if rank == 0:
            work = dist.irecv(x, 1)
            store.set("posted", str(os.getpid()))
            time.sleep(0.3)  # the receive's ready note reaches rank 1: its send is written at once
            os.kill(os.getpid(), signal.SIGSTOP)
            t0 = time.monotonic()  # continued once rank 1's send ended
        else:
            store.wait(["posted"])
            peer = int(store.get("posted"))
            while _state(peer) != "T":  # stopped
                time.sleep(0.01)
            if mode == "cut":
                socks = _connections({port})
                for sock in socks:
                    sock.shutdown(socket.SHUT_WR)
                t0 = time.monotonic()
                work = dist.isend(x, 0)
                for sock in socks:
                    sock.shutdown(socket.SHUT_RD)
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
    if peer is not None:
        os.kill(peer, signal.SIGCONT)
    print(json.dumps(out), flush=True)
    try:  # neither exits before the other is done (an exit would wake the other's wait)
        store.set(f"done/{rank}", "1")
        store.wait([f"done/{1 - rank}"], datetime.timedelta(seconds=30))
    finally:
        os._exit(0)  # the groups' destructors would wait on the broken pairs


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
