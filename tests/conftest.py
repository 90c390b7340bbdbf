"""Shared fixtures: the recipes' folder, a launch-and-collect helper, and a leak check for tests that start processes."""
from __future__ import annotations

import glob
import os
import re
import socket
import tempfile
import threading
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def launch_workers(out, script: list[str], **spec) -> tuple[int, dict[int, dict]]:
    """Run ``script`` under hotspare-run (``spec``: LaunchSpec fields) with ``out`` made first;
    the exit code and the JSON every finishing worker wrote into ``out``, by its rank."""
    import json

    from hotspare import launch

    out.mkdir(parents=True)
    code = launch.run(launch.LaunchSpec(script=script, **spec))
    results = {}
    for path in glob.glob(str(out / "*.json")):
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
        results[r["rank"]] = r
    return code, results


SOCKET_RE = re.compile(r"^hotspare-(?P<job>[A-Za-z0-9_.]+)-n\d+\.sock$")
LEAK_WAIT_S = 10.0
"""How long the test's own processes and entries get to go once it ended (a keeper whose launcher
was killed cleans up by itself)."""


@pytest.fixture
def no_leaks():
    """Fail if the test's own jobs leave child processes, /dev/shm entries or keeper sockets behind.

    A job's entries carry its job id and its keeper's pid (keeper segments
    ``hotspare-<job>-k<pid>-r<rank>-<n>``, sockets ``hotspare-<job>-n<node>.sock``, the CUDA
    driver's IPC files ``cuda.shm.<uid>.<pid, hex>.<n>``): the test's are those naming a process
    that descended from it while it ran, or a job id one of those carried. What another job (a
    test run beside this one) creates or leaves is not this test's to report."""
    shm_before = _shm()
    sockets_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "hotspare-*.sock")))
    ours = _Descendants()
    try:
        yield
    finally:
        ours.stop()
    deadline = time.monotonic() + LEAK_WAIT_S
    while True:
        children = [c for c in psutil.Process().children(recursive=True) if c.is_running()
                    and c.status() != psutil.STATUS_ZOMBIE]
        if not children or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not children, f"leaked child processes: {[(c.pid, c.cmdline()) for c in children]}"
    while True:
        segments = sorted(name for name in _shm() - shm_before if ours.made_segment(name))
        sockets = sorted(path for path in set(glob.glob(os.path.join(tempfile.gettempdir(), "hotspare-*.sock")))
                         - sockets_before if ours.made_socket(path))
        if not (segments or sockets) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not segments, f"leaked shared-memory entries: {segments}"
    assert not sockets, f"leaked keeper sockets: {sockets}"


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class _Descendants:
    """Every process that descends from this one while the test runs (looked up every
    ``POLL_S``: a keeper lives as long as its job, seconds at least), and the job ids they carry
    (a keeper's ``--job-id``, a worker's HOTSPARE_JOB_ID)."""

    POLL_S = 0.25

    def __init__(self):
        from hotspare import env

        self._job_var = env.HOTSPARE_JOB_ID.encode() + b"="
        self.pids: set[int] = set()
        self.jobs: set[str] = set()
        self._stop = threading.Event()
        self._look()
        self._thread = threading.Thread(target=self._run, name="no-leaks-descendants", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.POLL_S):
            self._look()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._look()

    def _look(self) -> None:
        from hotspare.keeper import safe_job_id

        for pid in _children_of(os.getpid()):
            if pid in self.pids:
                continue
            self.pids.add(pid)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                if b"--job-id" in argv[:-1]:
                    self.jobs.add(safe_job_id(argv[argv.index(b"--job-id") + 1].decode()))
                with open(f"/proc/{pid}/environ", "rb") as f:
                    for var in f.read().split(b"\0"):
                        if var.startswith(self._job_var) and len(var) > len(self._job_var):
                            self.jobs.add(safe_job_id(var[len(self._job_var):].decode()))
            except (OSError, UnicodeDecodeError):
                pass  # gone already: its pid is what names its entries

    def made_segment(self, name: str) -> bool:
        from hotspare.keeper import CUDA_IPC_RE, NAME_RE

        m = CUDA_IPC_RE.match(name)
        if m is not None:
            return int(m["pid"], 16) in self.pids
        m = NAME_RE.match(name)
        if m is None:
            return False
        # A keeper of this test's job whose pid was not seen (gone between two looks) is dead: a
        # live one with the same job id is another run's that uses that id too.
        return int(m["pid"]) in self.pids or (m["job"] in self.jobs and not psutil.pid_exists(int(m["pid"])))

    def made_socket(self, path: str) -> bool:
        m = SOCKET_RE.match(os.path.basename(path))
        if m is None or m["job"] not in self.jobs:
            return False
        return not _listened_on(path) or _listener_is_ours(path, self.pids)


def _children_of(root: int) -> list[int]:
    """The pids of ``root``'s descendants now, from each thread's /proc children list (the
    kernel keeps it: no scan of the whole process table)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _listened_on(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _listener_is_ours(path: str, pids: set[int]) -> bool:
    """Whether the keeper serving ``path`` descended from this test (a job id can be reused: a
    fixed one, run beside this test by another run, has the same socket name)."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info["cmdline"] or []
        if "hotspare.keeper" in argv and path in argv:
            return proc.info["pid"] in pids
    return True  # nobody says so: the test's own job id, so its socket
