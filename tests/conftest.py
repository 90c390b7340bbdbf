"""Shared fixtures: importable recipes, and a leak check for tests that start processes."""
from __future__ import annotations

import glob
import os
import socket
import sys
import tempfile
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
sys.path.insert(0, RECIPES)
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
    assert not (shm_after - shm_before), f"leaked shared-memory entries: {sorted(shm_after - shm_before)}"
    # A socket a live keeper listens on belongs to a job still running (another test run on the
    # machine); one that nobody listens on was left behind.
    leaked = [path for path in set(glob.glob(sockets)) - sockets_before if not _listened_on(path)]
    assert not leaked, f"leaked keeper sockets: {sorted(leaked)}"


def _listened_on(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()
