"""The processes a launcher starts: their record, how a failing exit is seen before the process
is gone, parent-death, stack dumps, signals to a worker's whole session."""
from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from .. import control


def log(msg: str) -> None:
    print(f"[hotspare-run] {msg}", file=sys.stderr, flush=True)


@dataclass
class Worker:
    """One process this launcher started."""

    wid: str
    node: int
    proc: subprocess.Popen
    rank: int = -1
    """Active rank, or -1 while a spare."""
    done: bool = False
    """Exit handled (reported or accepted)."""
    beat: int = -1
    """The sequence of the last heartbeat counted (-1: none yet)."""
    beat_seen: float = 0.0
    beat_timeout: float = 0.0
    pidfd: int = -1
    """A descriptor that turns readable when the process exits (Linux pidfd), -1 without one."""
    stat_fd: int = -1
    """/proc/<pid>/stat, open: read for a failing exit that has begun (:func:`exiting_status`)."""
    dying: bool = False
    """Its failing exit began and was reported; the process is still being torn down."""
    handing_over: bool = False
    """Asked to hand its rank over (``HANDOVER_SIGNAL`` sent): its exit with
    ``HANDED_OVER_EXIT_CODE`` is a handover, not a failure."""
    handover_generation: int = -1
    """The generation of the last handover order carried out for it (-1: none). A recovery voids
    an order; the coordinator's next one, in a later generation, is sent again."""

    def hand_over(self, order: "control.Handover") -> None:
        """The coordinator asked: the worker leaves at its next step boundary (hotspare.session.handover)."""
        if self.done or order.generation <= self.handover_generation:
            return
        self.handover_generation = order.generation
        if not signal_caught(self.proc.pid, control.HANDOVER_SIGNAL):
            # It does not listen (hotspare's initialize ran off the main thread, or hotspare is
            # off in its config): the signal would kill it mid-step.
            log(f"rank {order.rank} ({self.wid}) cannot hand its rank over: it does not listen for the handover "
                f"signal; it stays ({order.cause}: {order.detail})")
            return
        self.handing_over = True
        log(f"rank {order.rank} ({self.wid}) hands its rank to a spare at its next step boundary ({order.cause}: "
            f"{order.detail})")
        os.kill(self.proc.pid, control.HANDOVER_SIGNAL)

    def reason(self, code: int) -> str:
        """The reason a worker's exit with ``code`` is reported under."""
        return "handover" if self.handing_over and code == control.HANDED_OVER_EXIT_CODE else "exit"

    def __post_init__(self) -> None:
        if self.pidfd < 0 and hasattr(os, "pidfd_open"):
            try:
                self.pidfd = os.pidfd_open(self.proc.pid)
            except OSError:
                pass  # an old kernel: the launcher's poll sees the exit instead
        if self.stat_fd < 0:
            try:
                self.stat_fd = os.open(f"/proc/{self.proc.pid}/stat", os.O_RDONLY)
            except OSError:
                pass  # no procfs: the failure is seen when the process is gone

    def exiting(self) -> int | None:
        """The status of a failing exit under way (see :func:`exiting_status`), None otherwise."""
        return exiting_status(self.stat_fd) if self.stat_fd >= 0 and not self.dying else None

    def heard(self, beat: int | None, timeout_s: float | None, now: float) -> float | None:
        """Take the heartbeat the worker wrote last (None: none yet; its sequence, which only goes
        up; a goodbye is the negative of its sequence) and the timeout it asked for (read when a
        beat is counted while none is set); the seconds it has been silent when that is past its
        timeout, else None. A beat counts only past the last one counted: one replayed from
        earlier (signed, but old) is not news, so replaying two old beats does not hide a hang."""
        if beat is None:
            return None
        sequence = -beat if beat < 0 else beat
        # A goodbye is written one past the last beat; one at the last beat's sequence is taken too.
        if sequence > self.beat or (beat < 0 and sequence >= self.beat):
            self.beat, self.beat_seen = sequence, now
            self.beat_timeout = 0.0 if beat < 0 else (self.beat_timeout or timeout_s or 0.0)
        elif self.beat_timeout and now - self.beat_seen > self.beat_timeout:
            return now - self.beat_seen
        return None

    def finish(self) -> None:
        """Its exit is handled."""
        self.done = True
        for fd in (self.pidfd, self.stat_fd):
            if fd >= 0:
                os.close(fd)
        self.pidfd = self.stat_fd = -1


PF_EXITING = 0x4
EXIT_POLL_S = 0.005
"""How often the launcher reads its workers' /proc/<pid>/stat for a failing exit under way
(~5 us a worker; the pidfd wakes it only once the process is gone)."""


def pause(workers, seconds: float, stopping: bool) -> None:
    """Wait ``seconds``, cut short the moment one of ``workers`` exits (its pidfd turns readable)
    or begins a failing exit (its /proc stat, read every ``EXIT_POLL_S``)."""
    live = [w for w in workers if not w.done]
    fds = [w.pidfd for w in live if w.pidfd >= 0]
    watched = [w for w in live if w.stat_fd >= 0 and not w.dying and not stopping]
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        step = min(left, EXIT_POLL_S) if watched else left
        if fds:
            if select.select(fds, [], [], step)[0]:
                return
        else:
            time.sleep(step)
        if any(w.exiting() is not None for w in watched):
            return


def exiting_status(stat_fd: int) -> int | None:
    """Whether the process whose /proc/<pid>/stat is open at ``stat_fd`` has begun a failing
    exit: the status ``Popen.returncode`` will give (-signal, or the exit code), else None.

    A process killed (SIGKILL, an OOM kill, a crash) unmaps its memory before its descriptors
    close: its peers' connections reset, and its pidfd turns readable, only after that
    teardown, which takes ~16 ms for a process that imported torch and ~50 ms more per 500 MB
    it touched here (seconds for a trainer with tens of GB). The kernel sets the task's
    PF_EXITING flag and exit code before the teardown; /proc shows both (fields 9 and 52) to
    the parent within a millisecond. An exit with status 0 is not a failure: None.
    """
    try:
        data = os.pread(stat_fd, 1024, 0)
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    if len(fields) < 50:
        return None  # a kernel before 3.5 (no exit_code field)
    flags, status = int(fields[6]), int(fields[49])
    if not flags & PF_EXITING or status == 0:
        return None
    return -(status & 0x7F) if status & 0x7F else status >> 8


STACKS_WAIT_S = 1.0
"""At most this long for a stuck worker to take the signal that has it write its stacks."""


def signal_pending(pid: int, sig: int) -> bool:
    """``sig`` sent to process ``pid`` and not yet taken by it (``ShdPnd`` of /proc/<pid>/status)."""
    return _signal_bit(pid, sig, "ShdPnd:")


def signal_caught(pid: int, sig: int) -> bool:
    """Process ``pid`` has a handler for ``sig`` (``SigCgt``): sending it does not end the process."""
    return _signal_bit(pid, sig, "SigCgt:")


def _signal_bit(pid: int, sig: int, field: str) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child calls it, nothing more


def die_with_parent(parent_pid: int):
    """A ``preexec_fn``: the child is SIGKILLed when its parent (the launcher) dies, however it
    dies (Linux ``PR_SET_PDEATHSIG``, kept across exec); a parent already gone ends it at once.
    The launcher starts its children from its main thread (the signal follows the thread that
    forked)."""
    def pre() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return pre


def dump_stacks(p: subprocess.Popen) -> None:
    """Have a worker write its threads' stacks to its stderr (see control.STACKS_SIGNAL): send the
    signal, wait until the worker took it (a loaded machine may not run it at once), then give
    the handler a moment to write."""
    try:
        os.kill(p.pid, control.STACKS_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + STACKS_WAIT_S
    while signal_pending(p.pid, control.STACKS_SIGNAL) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)


def signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def spawn(script: list[str], worker_env: dict[str, str]) -> subprocess.Popen:
    """A worker's process: its own session, so that stopping it also stops whatever it spawned;
    and killed by the kernel if this launcher dies (nothing trains on without its launcher)."""
    return subprocess.Popen([sys.executable, *script], env=worker_env, start_new_session=True,
                            preexec_fn=die_with_parent(os.getpid()))


def worker_env(spec, world_size: int, num_nodes: int, port: int, job_id: str, signer, ifname: str,
               keeper_socket: str, node: int) -> dict[str, str]:
    """The environment every worker of logical node ``node`` starts with (its role, rank and id
    are added by the launcher)."""
    from .. import env

    s = spec
    out = dict(os.environ)
    out.update(s.extra_env)
    out.update({
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(s.nproc_per_node),
        "MASTER_ADDR": s.master_addr, "MASTER_PORT": str(port),
        env.HOTSPARE_STORE_HOST: s.master_addr, env.HOTSPARE_STORE_PORT: str(port),
        env.HOTSPARE_NODE_RANK: str(node), env.HOTSPARE_NUM_NODES: str(num_nodes),
        env.HOTSPARE_JOB_ID: job_id, env.HOTSPARE_GENERATION: "0",
        env.HOTSPARE_STORE_TIMEOUT_S: str(s.store_timeout_s), env.HOTSPARE_JOB_SECRET: signer.secret_hex(),
    })
    # NCCL: on a collective timeout abort the communicators and raise in the worker (2,
    # CleanUpOnly) instead of tearing the process down, so a survivor can recover in place.
    out.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    # A worker killed by a fatal signal (SIGSEGV, SIGABRT from a C++ terminate, ...) prints
    # every thread's Python stack: what the failure report needs to say where it died.
    out.setdefault("PYTHONFAULTHANDLER", "1")
    if ifname:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            out.setdefault(var, ifname)
    if keeper_socket:
        out[env.HOTSPARE_KEEPER_SOCKET] = keeper_socket
    return out
