"""Keeper: one process per node that owns the shared-memory segments holding its ranks'
retained state, outside the trainer processes (Leto's first tier).

``hotspare-run`` starts one keeper per (logical) node before the workers and stops it after
them. A trainer asks its keeper (over a Unix socket, path in ``HOTSPARE_KEEPER_SOCKET``) for
its rank's segment, maps it, and its mirror's own snapshots live there
(:mod:`hotspare.retain` has the format and the transactions). When the trainer dies and the
node lives, the segment lives on: the spare that takes the rank on this node asks the same
keeper for it and restores from it, with no network transfer of that state.

Lifecycle (nothing is left in /dev/shm):
- segment names carry the job id and the keeper's pid: ``hotspare-<job>-k<pid>-r<rank>-<n>``,
  so two jobs on one node never collide;
- a keeper that is stopped (SIGTERM/SIGINT), or whose launcher died (it watches its parent),
  unlinks every segment it created and its socket;
- a starting keeper removes the segments of keepers that are gone (a crashed job's), and
  logs each one.

Requests are one JSON object per connection, answered with one JSON object (local socket;
nothing is unpickled). With ``retain.device_tier`` the keeper also allocates, on the rank's GPU,
a buffer for a copy of its newest capture, and hands out its CUDA IPC handle
(:mod:`hotspare.devicemem`); torch is imported, and a CUDA context made, only then. A host-memory budget (``hotspare.retain.budget_mb``, sent with each
request) is enforced here: a rank whose two retained versions do not fit keeps only the
newest one, and one whose single version does not fit is not retained; each time, the log
and the answer say what was given up.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from .errors import HotspareError
from .retain import RetainedSegment, segment_size

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"^hotspare-(?P<job>[A-Za-z0-9_.]+)-k(?P<pid>\d+)-r(?P<rank>\d+)-(?P<seq>\d+)$")
MIB = 1 << 20


class KeeperError(HotspareError, RuntimeError):
    """The keeper refused a request or cannot be reached; the message says why and what to do."""


def safe_job_id(job_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", job_id) or "job"


def socket_path(job_id: str, node: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"hotspare-{safe_job_id(job_id)}-n{node}.sock")


def _is_live_keeper(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process: not ours to judge
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"hotspare.keeper" in f.read()
    except OSError:
        return True  # no /proc: alive is all we know


CUDA_IPC_RE = re.compile(r"^cuda\.shm\.\d+\.(?P<pid>[0-9a-f]+)\.\d+$")


def _unlink_matching(shm_dir: str, doomed) -> list[str]:
    """Unlink each file of ``shm_dir`` whose name ``doomed(name)`` accepts; returns their names."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if doomed(name):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except (FileNotFoundError, PermissionError):  # gone, or another user's (/dev/shm is sticky)
                pass
    return removed


def remove_cuda_ipc_files(pid: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the files the CUDA driver made in /dev/shm for process ``pid``'s IPC exports
    (``cuda.shm.<uid>.<pid, hex>.<n>``; seen on an H200 with CUDA 13: left behind when the
    exporting process exits). A keeper with a device tier calls it for itself as it stops, the
    launcher for a keeper it had to kill."""
    def doomed(name: str) -> bool:
        m = CUDA_IPC_RE.match(name)
        return m is not None and int(m["pid"], 16) == pid

    return _unlink_matching(shm_dir, doomed)


def remove_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every hotspare segment whose keeper is gone; returns the names removed."""
    def doomed(name: str) -> bool:
        m = NAME_RE.match(name)
        return m is not None and not _is_live_keeper(int(m["pid"]))

    return _unlink_matching(shm_dir, doomed)


@dataclass
class Held:
    rank: int
    path: str
    layout_id: int
    nbytes: int
    chunk_bytes: int
    num_slots: int
    size: int


class Keeper:
    """The keeper's state and request handling (the process loop is :meth:`serve`)."""

    def __init__(self, job_id: str, node: int, sock_path: str, shm_dir: str = SHM_DIR):
        self.job_id, self.node, self.sock_path, self.shm_dir = safe_job_id(job_id), node, sock_path, shm_dir
        self.held: dict[int, Held] = {}
        self.device_held: dict[int, tuple] = {}  # rank -> (tensor, its IPC handle as JSON, device index)
        self._seq = 0
        self._stop = False

    def log(self, msg: str) -> None:
        print(f"[hotspare keeper {self.node}] {msg}", file=sys.stderr, flush=True)

    # ---- requests -----------------------------------------------------------------------------

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "open":
            rank = int(req["rank"])
            reply = self._open(rank, int(req["layout_id"]), int(req["nbytes"]), int(req["chunk_bytes"]),
                               int(req.get("budget_bytes", 0)))
            device = req.get("device")
            if reply.get("ok") and reply["held"] is not None and device is not None:
                reply["device"], reply["device_note"] = self._open_device(rank, int(req["nbytes"]), int(device),
                                                                          reply["reused"])
            return reply
        if op == "lookup":
            rank = int(req["rank"])
            h = self.held.get(rank)
            d = self.device_held.get(rank)
            return {"ok": True, "held": asdict(h) if h else None, "device": d[1] if (h and d) else None}
        if op == "release":
            self._release(int(req["rank"]))
            return {"ok": True}
        if op == "stats":
            return {"ok": True, "held": [asdict(h) for h in self.held.values()],
                    "bytes": sum(h.size for h in self.held.values())}
        return {"ok": False, "error": f"unknown keeper request {op!r}"}

    def _open(self, rank: int, layout_id: int, nbytes: int, chunk_bytes: int, budget: int) -> dict:
        h = self.held.get(rank)
        if h is not None and (h.layout_id, h.nbytes, h.chunk_bytes) == (layout_id, nbytes, chunk_bytes):
            return {"ok": True, "held": asdict(h), "reused": True, "note": ""}
        if h is not None:
            grew = " (as when the first step makes the optimizer's state)" if nbytes > h.nbytes else ""
            self.log(f"rank {rank}'s state changed layout, {h.nbytes / MIB:.2f} -> {nbytes / MIB:.2f} MiB{grew}: "
                     f"its retained segment is replaced")
            self._release(rank)
        used = sum(x.size for x in self.held.values())
        note = ""
        num_slots = 2
        if budget and used + segment_size(nbytes, chunk_bytes, 2) > budget:
            num_slots = 1
            note = (f"the retention budget ({budget / MIB:.1f} MiB, {used / MIB:.1f} used) does not fit two versions "
                    f"of rank {rank}'s state ({nbytes / MIB:.1f} MiB each): the keeper keeps only its newest version "
                    f"(a crash in the middle of an update then leaves nothing here; the peers' copies still cover it)")
        if budget and used + segment_size(nbytes, chunk_bytes, 1) > budget:
            note = (f"the retention budget ({budget / MIB:.1f} MiB, {used / MIB:.1f} used) does not fit rank {rank}'s "
                    f"state ({nbytes / MIB:.1f} MiB): it is not retained on this node (the peers' copies still "
                    f"cover it); raise hotspare.retain.budget_mb to retain it")
            self.log(note)
            return {"ok": True, "held": None, "reused": False, "note": note}
        size = segment_size(nbytes, chunk_bytes, num_slots)
        st = os.statvfs(self.shm_dir)
        free = st.f_bavail * st.f_frsize
        if size > free:
            return {"ok": False, "error": (
                f"{self.shm_dir} on node {self.node} has {free / MIB:.1f} MiB free, and rank {rank}'s retained state "
                f"needs {size / MIB:.1f} MiB: give the container more shared memory (docker --shm-size, a Kubernetes "
                f"emptyDir with medium Memory at /dev/shm), or lower hotspare.retain.budget_mb, or set "
                f"hotspare.retain.keeper to false")}
        self._seq += 1
        path = os.path.join(self.shm_dir, f"hotspare-{self.job_id}-k{os.getpid()}-r{rank}-{self._seq}")
        try:
            RetainedSegment.create(path, rank, layout_id, nbytes, chunk_bytes, num_slots).close()
        except OSError as exc:
            return {"ok": False, "error": f"cannot create {path} ({exc}); is {self.shm_dir} full?"}
        h = Held(rank, path, layout_id, nbytes, chunk_bytes, num_slots, size)
        self.held[rank] = h
        if note:
            self.log(note)
        return {"ok": True, "held": asdict(h), "reused": False, "note": note}

    def _open_device(self, rank: int, nbytes: int, device: int, reused: bool) -> tuple[dict | None, str]:
        """Rank ``rank``'s buffer on GPU ``device`` (made now, or the one kept with its segment): its
        IPC handle, or None and why not (the host tier still retains the rank)."""
        d = self.device_held.get(rank)
        if d is not None and reused and d[2] == device and d[0].numel() == nbytes:
            return d[1], ""
        self.device_held.pop(rank, None)
        try:
            import torch

            from .devicemem import export

            buf = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
            wire = export(buf)
        except Exception as exc:  # noqa: BLE001 - no CUDA here, or no memory left on the GPU
            note = (f"rank {rank}'s state ({nbytes / MIB:.1f} MiB) cannot be retained on GPU {device} ({exc}); the "
                    f"keeper retains it in host memory only (hotspare.retain.device_tier)")
            self.log(note)
            return None, note
        self.device_held[rank] = (buf, wire, device)
        return wire, ""

    def _release(self, rank: int) -> None:
        self.device_held.pop(rank, None)
        h = self.held.pop(rank, None)
        if h is not None:
            try:
                os.unlink(h.path)
            except FileNotFoundError:
                pass

    # ---- the process ----------------------------------------------------------------------------

    def serve(self, parent_pid: int | None = None, ready_fd: int | None = None) -> None:
        """Answer requests until stopped (SIGTERM/SIGINT) or until the parent process is gone."""
        removed = remove_stale(self.shm_dir)
        if removed:
            self.log(f"removed {len(removed)} stale segment(s) of a job that ended without cleaning up: "
                     f"{', '.join(removed)}")
        if os.path.exists(self.sock_path):
            os.unlink(self.sock_path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.sock_path)
        srv.listen(64)
        srv.settimeout(0.2)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "_stop", True))
        if ready_fd is not None:
            os.write(ready_fd, b"1")
            os.close(ready_fd)
        try:
            while not self._stop:
                if parent_pid is not None and os.getppid() != parent_pid:
                    self.log("the launcher is gone; removing every segment and exiting")
                    break
                try:
                    conn, _ = srv.accept()
                except (socket.timeout, InterruptedError):
                    continue
                with conn:
                    self._answer(conn)
        finally:
            srv.close()
            exported = bool(self.device_held)
            for rank in list(self.held):
                self._release(rank)
            if exported:
                remove_cuda_ipc_files(os.getpid(), self.shm_dir)
            try:
                os.unlink(self.sock_path)
            except FileNotFoundError:
                pass

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        try:
            req = json.loads(read_line(conn))
            reply = self.handle(req)
        except (OSError, ValueError, KeyError) as exc:
            reply = {"ok": False, "error": f"bad keeper request: {exc}"}
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass  # the trainer died while asking: nothing to answer


def read_line(conn: socket.socket) -> bytes:
    """One request or answer: a JSON object on one line."""
    data = b""
    while not data.endswith(b"\n"):
        part = conn.recv(65536)
        if not part:
            break
        data += part
    return data


def start(job_id: str, node: int, sock_path: str, shm_dir: str = SHM_DIR, timeout_s: float = 30.0):
    """Start a keeper process for ``node`` (the launcher does); returns the Popen once it listens."""
    import subprocess

    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "hotspare.keeper", "--job-id", job_id, "--node", str(node),
                             "--socket", sock_path, "--shm-dir", shm_dir, "--parent-pid", str(os.getpid()),
                             "--ready-fd", str(w)], pass_fds=(w,), start_new_session=True)
    os.close(w)
    deadline = time.monotonic() + timeout_s
    try:
        import select

        while time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], 0.1)
            if ready:
                if os.read(r, 1) == b"1":
                    return proc
                break
            if proc.poll() is not None:
                break
    finally:
        os.close(r)
    proc.kill()
    proc.wait()
    raise KeeperError(f"the keeper for node {node} did not start (exit status {proc.returncode})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hotspare.keeper", description=__doc__.split("\n\n")[0])
    p.add_argument("--job-id", required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--shm-dir", default=SHM_DIR)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--ready-fd", type=int, default=None)
    a = p.parse_args(argv)
    Keeper(a.job_id, a.node, a.socket, a.shm_dir).serve(a.parent_pid, a.ready_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
