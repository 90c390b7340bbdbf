"""A hotspare job run in the background, as an operator would run it, for the tests, the
benchmarks and the fault matrix: :class:`Job` starts ``hotspare-run`` in a process of its own
with a job id and secret chosen here, and exposes what a test acts on (the store's port, the
current plan, the process of each worker, stop) from the job itself: the launcher's own
listening socket and process tree, and the control store read with the job's secret. Nothing
is read back from its log but the tail a report shows.

Also the readers of what a finished job wrote: :func:`ranks_of` (each rank's result JSON) and
:func:`count_events` (the event logs).
"""
from __future__ import annotations

import glob
import itertools
import json
import os
import signal
import subprocess
import sys
import time

from .. import control
from ..control import auth
from ..generation import connect_store
from ..launch import LaunchSpec
from ..report import read_events

_ids = itertools.count()


class Job:
    """``hotspare-run`` for ``spec`` in the background; its output goes to ``out_dir/launcher.log``.

    A job id and a job secret file are made for it unless ``spec`` names them, so that this
    handle reads the job's control store as the job does (signed values only). ``wrap`` turns
    the launcher's command line into the one to run (a network namespace's, say: the
    environment then travels in the command line).
    """

    def __init__(self, spec: LaunchSpec, out_dir: str, *, name: str = "job", log_name: str = "launcher.log",
                 wrap=None):
        os.makedirs(out_dir, exist_ok=True)
        if not spec.job_id:
            spec.job_id = f"{name}{os.getpid()}x{next(_ids)}"
        if not spec.job_secret_file:
            spec.job_secret_file = auth.write_secret_file(os.path.join(out_dir, "job.secret"))
        self.spec = spec
        self.log_path = os.path.join(out_dir, log_name)
        self.started = time.monotonic()
        argv = [sys.executable, "-m", "hotspare.launch", *spec.to_argv()]
        if wrap is not None:
            argv = wrap(["env", *[f"{k}={v}" for k, v in spec.extra_env.items()], *argv])
        with open(self.log_path, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **spec.extra_env})
        self._port = spec.master_port or None
        self._store = None
        self._seen: dict[int, object] = {}  # pid -> psutil.Process, every process of the job seen so far

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    def running(self) -> bool:
        return self.proc.poll() is None

    def port(self, timeout_s: float = 60.0) -> int:
        """The control store's port: the TCP socket the launcher listens on (it picks a free one
        when the spec says 0)."""
        import psutil

        deadline = time.monotonic() + timeout_s
        while self._port is None:
            try:
                listening = [c.laddr.port for c in psutil.Process(self.proc.pid).net_connections(kind="tcp")
                             if c.status == psutil.CONN_LISTEN]
            except psutil.Error:
                listening = []
            if len(listening) == 1:
                self._port = listening[0]
            elif not self.running() or time.monotonic() > deadline:
                raise RuntimeError(f"the launcher of job {self.job_id} listens on {listening or 'no port'} after "
                                   f"{time.monotonic() - self.started:.0f} s (exit code {self.proc.poll()}); "
                                   f"its log: {self.log_path}")
            else:
                time.sleep(0.05)
        return self._port

    def control(self) -> control.ControlStore:
        """The job's control store, read and written with the job's secret."""
        if self._store is None:
            raw = connect_store(self.spec.master_addr, self.port(), 60)
            signer = auth.Signer(auth.read_secret_file(self.spec.job_secret_file), self.job_id)
            self._store = control.ControlStore(raw, signer)
        return self._store

    def plan(self, world_size: int) -> control.Plan:
        """The job's newest plan (which worker holds each rank)."""
        return self.control().current_plan(world_size)

    def processes(self) -> list:
        """The job's live processes: the launcher's descendants (workers, spares, keepers), and any
        seen before that outlived their parent."""
        import psutil

        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self._seen.setdefault(p.pid, p)
        except psutil.Error:
            pass
        alive = []
        for pid, p in list(self._seen.items()):
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
                    continue
            except psutil.Error:
                pass
            del self._seen[pid]
        return alive

    def pid_of(self, worker: str) -> int | None:
        """The process of worker ``worker`` (``a<rank>``, ``s<node>.<k>``), or None."""
        import psutil

        for p in self.processes():
            try:
                if p.environ().get("HOTSPARE_WORKER_ID") == worker:
                    return p.pid
            except psutil.Error:
                continue
        return None

    def keeper_pids(self) -> list[int]:
        import psutil

        out = []
        for p in self.processes():
            try:
                if "hotspare.keeper" in " ".join(p.cmdline()):
                    out.append(p.pid)
            except psutil.Error:
                continue
        return out

    def kill(self, worker: str, sig: int = signal.SIGKILL) -> bool:
        """Send ``sig`` to ``worker``'s process; False when it has none."""
        pid = self.pid_of(worker)
        if pid is None:
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout_s: float) -> int | None:
        """The launcher's exit code; None when it was still running after ``timeout_s`` (it is then
        stopped: :meth:`stop`)."""
        try:
            return self.proc.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            self.stop()
            return None

    def stop(self) -> None:
        """SIGTERM the launcher (it stops its workers and keepers, SIGKILL after its grace period),
        then SIGKILL it and every process of the job still there (a stopped worker, say)."""
        self.processes()  # the tree, before the launcher's exit re-parents it
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for p in self.processes():
            try:
                p.kill()
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass

    def tail(self, nbytes: int = 4000) -> str:
        """The end of the launcher's output (for a report)."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-nbytes:]


def sweep(job_id: str) -> list[int]:
    """Every live process on this machine that belongs to job ``job_id`` (its environment or its
    command line names it), whoever its parent is now: the check that nothing of a job outlived
    its launcher. (To act on a running job's workers, use :class:`Job`.)"""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = p.cmdline()
            if p.environ().get("HOTSPARE_JOB_ID") == job_id or \
                    any(a == "--job-id" and b == job_id for a, b in zip(cmd, cmd[1:])):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def ranks_of(out_dir: str) -> dict[int, dict]:
    """Each rank's result (``rank<R>.json``, written by the recipes' workers at the end), by rank."""
    out = {}
    for path in glob.glob(os.path.join(out_dir, "rank*.json")):
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
        out[r["rank"]] = r
    return out


def count_events(events_dir: str, kind: str) -> int:
    """How many events of ``kind`` the job's event logs hold so far (it may still be running)."""
    return sum(e.get("kind") == kind for e in read_events(events_dir, running=True))


def training_started(events_dir: str) -> bool:
    """Some rank started mirroring (it is past ``initialize``: the job trains)."""
    return count_events(events_dir, "mirror_start") > 0
