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
nothing is unpickled). A host-memory budget (``hotspare.retain.budget_mb``, sent with each
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

from .retain import RetainedSegment, SegmentError, segment_size

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"^hotspare-(?P<job>[A-Za-z0-9_.]+)-k(?P<pid>\d+)-r(?P<rank>\d+)-(?P<seq>\d+)$")
MIB = 1 << 20


class KeeperError(RuntimeError):
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


def remove_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every hotspare segment whose keeper is gone; returns the names removed."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        m = NAME_RE.match(name)
        if m is None or _is_live_keeper(int(m["pid"])):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


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
        self._seq = 0
        self._stop = False

    def log(self, msg: str) -> None:
        print(f"[hotspare keeper {self.node}] {msg}", file=sys.stderr, flush=True)

    # ---- requests -----------------------------------------------------------------------------

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "open":
            return self._open(int(req["rank"]), int(req["layout_id"]), int(req["nbytes"]), int(req["chunk_bytes"]),
                              int(req.get("budget_bytes", 0)))
        if op == "lookup":
            h = self.held.get(int(req["rank"]))
            return {"ok": True, "held": asdict(h) if h else None}
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
            self.log(f"rank {rank}'s state changed layout: its retained segment is replaced")
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

    def _release(self, rank: int) -> None:
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
            for rank in list(self.held):
                self._release(rank)
            try:
                os.unlink(self.sock_path)
            except FileNotFoundError:
                pass

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        try:
            req = json.loads(_read_line(conn))
            reply = self.handle(req)
        except (OSError, ValueError, KeyError) as exc:
            reply = {"ok": False, "error": f"bad keeper request: {exc}"}
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass  # the trainer died while asking: nothing to answer


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        part = conn.recv(65536)
        if not part:
            break
        data += part
    return data


class KeeperClient:
    """A trainer's handle on its node's keeper."""

    def __init__(self, sock_path: str, timeout_s: float = 10.0):
        self.sock_path, self.timeout_s = sock_path, timeout_s

    def request(self, op: str, **fields) -> dict:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            s.connect(self.sock_path)
            s.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
            reply = json.loads(_read_line(s) or b"{}")
        except (OSError, ValueError) as exc:
            raise KeeperError(f"the node's keeper at {self.sock_path} did not answer {op!r} ({exc}); is hotspare-run "
                              f"still running on this node?") from None
        finally:
            s.close()
        if not reply.get("ok"):
            raise KeeperError(reply.get("error") or f"the keeper refused {op!r}")
        return reply

    def open(self, rank: int, layout_id: int, nbytes: int, chunk_bytes: int,
             budget_bytes: int = 0) -> tuple[RetainedSegment | None, str]:
        """Rank ``rank``'s segment for this layout (made now, or the one kept: same layout), mapped;
        None when the budget leaves it out. Also returns the keeper's note on what it gave up."""
        reply = self.request("open", rank=rank, layout_id=layout_id, nbytes=nbytes, chunk_bytes=chunk_bytes,
                             budget_bytes=budget_bytes)
        held = reply["held"]
        return (RetainedSegment.attach(held["path"]) if held else None), reply.get("note", "")

    def lookup(self, rank: int) -> RetainedSegment | None:
        """The segment this keeper holds for ``rank`` (a dead rank's, for the spare that takes it)."""
        held = self.request("lookup", rank=rank)["held"]
        if held is None:
            return None
        try:
            return RetainedSegment.attach(held["path"])
        except SegmentError:
            return None

    def stats(self) -> dict:
        return self.request("stats")

    # ---- what a trainer does with it --------------------------------------------------------------

    def snapshots_for(self, rank: int, chunk_bytes: int, budget_bytes: int, note):
        """A mirror's ``snapshots`` provider: rank ``rank``'s own snapshots in this keeper's segment
        (private memory when the budget leaves the rank out; ``note(text)`` hears what was given up)."""
        from .mirror import PrivateSnapshots
        from .retain import RetainedSnapshots

        def make(layout):
            segment, given_up = self.open(rank, layout.id, layout.nbytes, chunk_bytes, budget_bytes)
            if given_up:
                note(given_up)
            if segment is None:
                return PrivateSnapshots(layout)
            return RetainedSnapshots(segment, layout)

        return make

    def take_over(self, rank: int, layout_for) -> tuple[RetainedSegment | None, dict[int, int], dict]:
        """What this node's keeper retained of ``rank`` (a dead rank whose place this spare takes):
        (segment, {version: slot} of the complete versions whose every chunk passes its checksum
        or was sealed by a writer that died before checksumming it (``unverified_chunks``; see
        :mod:`hotspare.retain`), details for the event log). ``layout_for(layout_id)`` is this engine's layout with that
        id, or None: a segment of another layout is not used."""
        segment = self.lookup(rank)
        if segment is None:
            return None, {}, {"retained": False}
        if layout_for(segment.layout_id) is None:
            detail = {"retained": True, "layout_mismatch": f"{segment.layout_id:x}"}
            segment.close()
            return None, {}, detail
        complete = segment.complete_versions()
        corrupt = {v: segment.verify(s) for v, s in complete.items()}
        good = {v: s for v, s in complete.items() if not corrupt[v]}
        pending = {str(v): len(segment.unverified(s)) for v, s in good.items()}
        return segment, good, {"retained": True, "complete": sorted(complete), "verified": sorted(good),
                               "corrupt_chunks": {str(v): c for v, c in corrupt.items() if c},
                               "unverified_chunks": {v: n for v, n in pending.items() if n}}


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
