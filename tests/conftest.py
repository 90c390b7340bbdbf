"""Shared fixtures: the recipes' folder, a launch-and-collect helper, and a leak check for tests that start processes."""
from __future__ import annotations

import glob
import os
import socket
import tempfile
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


@pytest.fixture
def no_leaks():
    """Fail if the test leaves child processes, new /dev/shm entries or keeper sockets behind."""
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    sockets = os.path.join(tempfile.gettempdir(), "hotspare-*.sock")
    sockets_before = set(glob.glob(sockets))
    yield
    deadline = time.monotonic() + 10
    while True:
        children = [c for c in psutil.Process().children(recursive=True) if c.is_running()
                    and c.status() != psutil.STATUS_ZOMBIE]
        if not children or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not children, f"leaked child processes: {[(c.pid, c.cmdline()) for c in children]}"
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    new = [name for name in shm_after - shm_before if not _another_jobs_segment(name)]
    assert not new, f"leaked shared-memory entries: {sorted(new)}"
    # A socket a live keeper listens on belongs to a job still running (another test run on the
    # machine); one that nobody listens on was left behind.
    leaked = [path for path in set(glob.glob(sockets)) - sockets_before if not _listened_on(path)]
    assert not leaked, f"leaked keeper sockets: {sorted(leaked)}"


def _another_jobs_segment(name: str) -> bool:
    """A keeper segment whose keeper is alive and not this test's (a job running beside the suite)."""
    from hotspare.keeper import NAME_RE

    m = NAME_RE.match(name)
    if m is None:
        return False
    pid = int(m.group("pid"))
    try:
        keeper = psutil.Process(pid)
        ours = any(p.pid == os.getpid() for p in keeper.parents())
        return keeper.status() != psutil.STATUS_ZOMBIE and not ours
    except psutil.NoSuchProcess:
        return False


def _listened_on(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()
