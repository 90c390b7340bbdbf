"""hotspare-run: the per-node launcher.

It mirrors torchrun's flags, starts this node's workers, and owns the control store
(a TCPStore on node 0) so the store outlives any worker. Workers get torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
plus the ``HOTSPARE_*`` variables of :mod:`hotspare.env`.

``--logical-nodes L`` splits one machine's workers into L logical nodes (for tests and
recipes that need "other nodes" on one host); each worker's HOTSPARE_NODE_RANK is its
logical node.

Before its workers it starts one keeper per (logical) node (:mod:`hotspare.keeper`): the
process that owns the node's retained shared-memory segments; it is stopped after them and
then removes every segment.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from . import control, env, keeper
from .control import auth
from .coordinator import Coordinator, describe_exit

POLL_INTERVAL_S = 0.02
ABORT_EXIT_CODE = 3
"""Exit code when a worker found the job unrecoverable (``control.ABORT``): state was lost."""
FENCED_EXIT_CODE = 4
"""Exit code of a launcher that lost the control store for ``node_timeout_s`` and stopped its
workers (partitioned from node 0, or node 0 died)."""


@dataclass
class LaunchSpec:
    """What one launcher starts."""

    script: list[str]
    """Command after the interpreter: a script path and its arguments, or ['-m', module, ...]."""
    nproc_per_node: int = 1
    """Active worker processes on this node."""
    nnodes: int = 1
    """Number of launchers (physical nodes) in the job."""
    node_rank: int = 0
    """This launcher's node index."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where the control store runs; advertised to every worker as is."""
    master_port: int = 0
    """Control-store port; 0 picks a free one (single-node jobs only)."""
    logical_nodes: int = 1
    """Logical nodes this machine's workers are split into (nnodes must be 1 when > 1)."""
    spares_per_node: int = 0
    """Standby workers per (logical) node; each can take the place of a failed rank."""
    job_id: str = ""
    """Job identifier (shared-memory and log names); random when empty."""
    store_timeout_s: float = 60.0
    """How long workers wait to reach the store; also the store's own timeout."""
    term_grace_s: float = 10.0
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    settle_s: float = 0.05
    """After a failure, how long the coordinator waits for further failures before it plans,
    unless every other worker reported that it left the generation first (a failure after the
    plan is handled too: the generation being formed is superseded)."""
    stall_grace_s: float = 5.0
    """After a survivor reports a failure no launcher saw, how long every other active worker
    has to report it too; one that does not is stuck (alive, beating, not in the collective)
    and is killed and replaced. When all report, the same workers form the next generation.
    Likewise after any failure: a member of the failed generation that has neither failed nor
    said it left is killed as stuck, this long after the alarm at least, and not before the
    others' rendezvous is four fifths through (one busy in a phase with no collective, such as a
    synchronous checkpoint save, that long is killed too)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Added to every worker's environment."""
    keeper: bool = True
    """Start a keeper per (logical) node (off: ranks retain nothing outside their processes)."""
    spares_only: bool = False
    """Join a running job with spares only (no active ranks): a replacement node, started with a
    ``--node-rank`` the job does not use yet (at least ``--nnodes``) and the job's store address."""
    spare_wait_s: float = 0.0
    """When more ranks fail than spares are ready: 0 stops the job cleanly (naming the spares it
    needed); more waits this long for spares to register first (still starting, or brought by a
    ``--spares-only`` launcher on a replacement node), then stops."""
    node_timeout_s: float = 10.0
    """Several launchers (``--nnodes`` > 1): each beats ``node/<n>/hb`` in the store; node 0
    declares a node lost (every rank on it failed) when its beat is this stale, and a launcher
    that cannot reach the store this long stops its own workers and exits (fencing)."""
    successor_wait_s: float = 30.0
    """After a takeover, at most how long the launcher waits before it starts the promoted
    spare's successor. It starts it as soon as the recovered generation is back at the step the
    failure interrupted (rank 0's ``caught_up/<g>``), or at once when another failure comes: the
    successor's warm-up (imports, model build: seconds of CPU) then never competes with the
    recovery and the replayed step it follows. 0 starts it with the plan."""
    advertise_addr: str = ""
    """This node's address for the workers' collectives (gloo, NCCL's bootstrap); empty: the
    address this machine reaches ``master_addr`` from. Logged at start."""
    job_secret_file: str = ""
    """The job secret that signs every control-store value (the same owner-only file on every
    node; ``HOTSPARE_JOB_SECRET_FILE`` when the flag is not given). Empty: node 0 makes one,
    for a job on one machine only."""

    def node_of_rank(self, rank: int) -> int:
        """The (logical) node a rank starts on."""
        return rank // (self.nproc_per_node // self.logical_nodes)

    def node_of_worker(self, wid: str) -> int:
        """The (logical) node a worker runs on: an active rank's start node, a spare's own."""
        if wid.startswith("s"):
            return int(wid[1:].split(".")[0])
        return self.node_of_rank(int(wid[1:]))

    def to_argv(self) -> list[str]:
        """hotspare-run's command line for this spec (``extra_env``, ``settle_s`` and
        ``term_grace_s`` have no flag: pass the environment to the process yourself)."""
        argv = [f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}", f"--node-rank={self.node_rank}",
                f"--master-addr={self.master_addr}", f"--master-port={self.master_port}",
                f"--logical-nodes={self.logical_nodes}", f"--spares-per-node={self.spares_per_node}",
                f"--store-timeout={self.store_timeout_s}", f"--stall-grace-s={self.stall_grace_s}",
                f"--node-timeout-s={self.node_timeout_s}", f"--spare-wait-s={self.spare_wait_s}",
                f"--successor-wait-s={self.successor_wait_s}"]
        if self.spares_only:
            argv.append("--spares-only")
        if self.job_id:
            argv.append(f"--job-id={self.job_id}")
        if not self.keeper:
            argv.append("--no-keeper")
        if self.advertise_addr:
            argv.append(f"--advertise-addr={self.advertise_addr}")
        if self.job_secret_file:
            argv.append(f"--job-secret-file={self.job_secret_file}")
        script = self.script
        if script and script[0] == "-m":
            argv.append("-m")
            script = script[1:]
        return argv + list(script)

    def validate(self) -> None:
        """Every field checked, each error naming its flag (ValueError)."""
        for flag, value, low in (("--store-timeout", self.store_timeout_s, 0.0), ("--stall-grace-s", self.stall_grace_s, 0.0),
                                 ("--node-timeout-s", self.node_timeout_s, 0.0)):
            if not (math.isfinite(value) and value > low):
                raise ValueError(f"{flag}={value} must be a finite number > {low:g}")
        for flag, value in (("--spare-wait-s", self.spare_wait_s), ("--successor-wait-s", self.successor_wait_s),
                            ("term_grace_s", self.term_grace_s), ("settle_s", self.settle_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{flag}={value} must be a finite number >= 0")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"--master-port={self.master_port} is not a port (1-65535; 0: any free one, one node only)")
        if not self.master_addr:
            raise ValueError("--master-addr is empty")
        try:
            socket.getaddrinfo(self.master_addr, None)
        except (OSError, UnicodeError) as exc:
            raise ValueError(f"--master-addr={self.master_addr!r} does not resolve ({exc})") from None
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node={self.nproc_per_node} must be at least 1")
        if self.spares_only:
            if self.node_rank < self.nnodes or self.spares_per_node < 1 or self.master_port == 0:
                raise ValueError(f"--spares-only joins a running job as a new node: it needs --node-rank >= "
                                 f"--nnodes={self.nnodes} (got {self.node_rank}), --spares-per-node >= 1 (got "
                                 f"{self.spares_per_node}) and the job's --master-addr/--master-port")
        elif self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in [0, --nnodes={self.nnodes})")
        if self.logical_nodes < 1:
            raise ValueError(f"--logical-nodes={self.logical_nodes} must be at least 1")
        if self.logical_nodes > 1 and self.nnodes > 1:
            raise ValueError("--logical-nodes splits one machine; use it only with --nnodes=1")
        if self.nproc_per_node % self.logical_nodes:
            raise ValueError(f"--nproc-per-node={self.nproc_per_node} is not divisible by "
                             f"--logical-nodes={self.logical_nodes}")
        if self.spares_per_node < 0:
            raise ValueError(f"--spares-per-node={self.spares_per_node} must be >= 0")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("--master-port is required when --nnodes > 1 (every launcher must find the store)")
        if (self.nnodes > 1 or self.spares_only) and not self.job_secret_file:
            raise ValueError("--job-secret-file (or HOTSPARE_JOB_SECRET_FILE) is required when --nnodes > 1 or "
                             "--spares-only: every node's launcher signs and checks the job's control messages "
                             "with the same secret (make one: head -c 32 /dev/urandom | xxd -p > FILE; "
                             "chmod 600 FILE; see docs/control-plane.md)")
        if not self.script:
            raise ValueError("no training script given")


def _log(msg: str) -> None:
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
    beat_seen: float = 0.0
    beat_timeout: float = 0.0
    pidfd: int = -1
    """A descriptor that turns readable when the process exits (Linux pidfd), -1 without one."""
    stat_fd: int = -1
    """/proc/<pid>/stat, open: read for a failing exit that has begun (:func:`exiting_status`)."""
    dying: bool = False
    """Its failing exit began and was reported; the process is still being torn down."""

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


class Launcher:
    """Starts and watches this node's workers; node 0's launcher also coordinates recoveries.

    Unlike torchrun, a failed worker does not stop the others: it is reported to the control
    store, the coordinator (node 0) plans which spare takes its rank in a new generation, and
    the spare's launcher starts a new spare. Without a spare the job stops with the failed
    worker's exit code.
    """

    def __init__(self, spec: LaunchSpec):
        spec.validate()
        self.spec = spec
        self.job_id = spec.job_id or uuid.uuid4().hex[:12]
        secret = auth.read_secret_file(spec.job_secret_file) if spec.job_secret_file else auth.new_secret()
        self.signer = auth.Signer(secret, self.job_id)
        self.store = None
        self.control: control.ControlStore | None = None  # signed operations on ``store``, once it is open
        self.advertise_addr, self.advertise_ifname = spec.advertise_addr, ""
        self.port = 0
        self.workers: dict[str, Worker] = {}
        self.generation = 0
        self.exit_code: int | None = None
        self._spare_counter: dict[int, int] = {}
        self._stopping = False
        self._released = False  # spares woken to see "shutdown"
        self._kill_read = 0
        self._bad_beats: set[str] = set()  # workers whose heartbeat key held something else (said once)
        self._said_finished: set[int] = set()  # this node's ranks written to finished/<rank>
        self._keepers_gone: set[int] = set()  # nodes whose keeper exited while the job ran (said once)
        self.keepers: dict[int, subprocess.Popen] = {}  # (logical) node -> its keeper
        self.coordinator: Coordinator | None = None  # node 0 only
        self._beat_stop = threading.Event()
        self._successors: list[_Successor] = []  # registered, not started yet

    @property
    def world_size(self) -> int:
        return self.spec.nnodes * self.spec.nproc_per_node

    def _open_store(self) -> int:
        import torch.distributed as dist

        from .generation import connect_store

        s = self.spec
        if s.node_rank != 0:
            self.store = connect_store(s.master_addr, s.master_port, s.store_timeout_s)
            try:
                theirs = control.ControlStore(self.store, self.signer).job_id()
            except control.BadMessage as exc:
                raise ValueError(f"the control store at {s.master_addr}:{s.master_port}: {exc}; give every "
                                 f"node's hotspare-run the same --job-secret-file") from None
            if theirs is None:
                raise ValueError(f"the control store at {s.master_addr}:{s.master_port} serves no job yet (node 0's "
                                 f"hotspare-run writes its id first)")
            if s.job_id and s.job_id != theirs:
                raise ValueError(f"--job-id={s.job_id}, but the control store at {s.master_addr}:{s.master_port} "
                                 f"serves job {theirs}: start every node's hotspare-run with the same --job-id (or "
                                 f"none: the others take node 0's)")
            self.job_id = theirs
            self.signer = self.signer.for_job(theirs)
            self.control = control.ControlStore(self.store, self.signer)
            return s.master_port
        # The store listens on the address the launcher was given only (127.0.0.1 on one
        # machine), not on every interface as TCPStore's own socket would.
        listener = listen_socket(s.master_addr, s.master_port)
        self.store = dist.TCPStore(s.master_addr, listener.getsockname()[1], is_master=True,
                                   timeout=datetime.timedelta(seconds=s.store_timeout_s), wait_for_workers=False,
                                   master_listen_fd=listener.fileno())
        listener.detach()  # the store owns the descriptor now and closes it when it goes
        self.control = control.ControlStore(self.store, self.signer)
        self.control.publish_job(self.job_id)
        return self.store.port

    def _beat(self) -> None:
        """Nodes other than 0: beat ``node/<n>/hb`` (an add: the store's reply proves it arrived)
        over a connection of its own, and fence when the store has been out of reach too long.
        A call to a store behind a cut link can block for a long time, so a watch thread of its
        own measures the silence."""
        from .generation import connect_store

        s = self.spec
        interval = max(0.1, s.node_timeout_s / 10)
        self._beat_ok = time.monotonic()

        def watch() -> None:
            while not self._beat_stop.wait(interval):
                silent = time.monotonic() - self._beat_ok
                if silent > s.node_timeout_s:
                    self._fence(silent)

        threading.Thread(target=watch, name="hotspare-node-fence", daemon=True).start()
        store, beats = None, 0
        while not self._beat_stop.wait(interval):
            try:
                if store is None:
                    store = control.ControlStore(connect_store(s.master_addr, s.master_port, s.node_timeout_s),
                                                 self.signer)
                beats += 1
                store.beat_node(s.node_rank, beats)
                self._beat_ok = time.monotonic()
            except Exception:  # noqa: BLE001 - any failure to reach the store counts as silence
                store = None

    def _fence(self, silent_s: float) -> None:
        """This node lost the control store: stop every worker and keeper of this node, so that
        nothing acts on a stale view of the job (node 0 has declared this node lost and given its
        ranks to spares by now), and exit with FENCED_EXIT_CODE."""
        _log(f"node {self.spec.node_rank} cannot reach the control store at {self.spec.master_addr}:"
             f"{self.spec.master_port} for {silent_s:.1f} s (partitioned from node 0, or node 0 is down): "
             f"stopping this node's workers (fenced), exit code {FENCED_EXIT_CODE}")
        for w in self.workers.values():
            if w.proc.poll() is None:
                _signal_group(w.proc, signal.SIGKILL)
        for k in self.keepers.values():
            k.terminate()  # the keeper removes its segments
        for k in self.keepers.values():
            try:
                k.wait(timeout=self.spec.term_grace_s)
            except subprocess.TimeoutExpired:
                k.kill()
        os._exit(FENCED_EXIT_CODE)

    def _advertise(self) -> None:
        """The address this node's workers talk from, and its interface: gloo (and NCCL's
        bootstrap) are told to use it, so no collective traffic goes out another network."""
        s = self.spec
        self.advertise_addr = s.advertise_addr or route_to(s.master_addr)
        self.advertise_ifname = interface_of(self.advertise_addr)
        where = f"interface {self.advertise_ifname}" if self.advertise_ifname else "no local interface has it"
        _log(f"node {s.node_rank} advertises {self.advertise_addr} ({where})")

    @property
    def num_nodes(self) -> int:
        """(Logical) nodes of the job."""
        return self.spec.logical_nodes if self.spec.logical_nodes > 1 else self.spec.nnodes


    def _local_nodes(self) -> list[int]:
        s = self.spec
        return list(range(s.logical_nodes)) if s.logical_nodes > 1 else [s.node_rank]

    def _base_env(self, node: int) -> dict[str, str]:
        s = self.spec
        worker_env = dict(os.environ)
        worker_env.update(s.extra_env)
        worker_env.update({
            "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(s.nproc_per_node),
            "MASTER_ADDR": s.master_addr, "MASTER_PORT": str(self.port),
            env.HOTSPARE_STORE_HOST: s.master_addr, env.HOTSPARE_STORE_PORT: str(self.port),
            env.HOTSPARE_NODE_RANK: str(node), env.HOTSPARE_NUM_NODES: str(self.num_nodes),
            env.HOTSPARE_JOB_ID: self.job_id, env.HOTSPARE_GENERATION: "0",
            env.HOTSPARE_STORE_TIMEOUT_S: str(s.store_timeout_s), env.HOTSPARE_JOB_SECRET: self.signer.secret_hex(),
        })
        # NCCL: on a collective timeout abort the communicators and raise in the worker (2,
        # CleanUpOnly) instead of tearing the process down, so a survivor can recover in place.
        worker_env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        # A worker killed by a fatal signal (SIGSEGV, SIGABRT from a C++ terminate, ...) prints
        # every thread's Python stack: what the failure report needs to say where it died.
        worker_env.setdefault("PYTHONFAULTHANDLER", "1")
        if self.advertise_ifname:
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                worker_env.setdefault(var, self.advertise_ifname)
        if node in self.keepers:
            worker_env[env.HOTSPARE_KEEPER_SOCKET] = keeper.socket_path(self.job_id, node)
        return worker_env

    def _spawn(self, worker_env: dict[str, str]) -> subprocess.Popen:
        # Own session per worker, so stopping one also stops whatever it spawned; and killed
        # by the kernel if this launcher dies (nothing trains on without its launcher).
        return subprocess.Popen([sys.executable, *self.spec.script], env=worker_env, start_new_session=True,
                                preexec_fn=die_with_parent(os.getpid()))

    def _start_active(self, local_rank: int) -> None:
        rank = self.spec.node_rank * self.spec.nproc_per_node + local_rank
        wid = control.active_id(rank)
        node = self.spec.node_of_rank(rank)
        worker_env = self._base_env(node)
        worker_env.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank), env.HOTSPARE_ROLE: "active",
                           env.HOTSPARE_WORKER_ID: wid})
        self.workers[wid] = Worker(wid, node, self._spawn(worker_env), rank=rank)

    def _start_spare(self, node: int) -> Worker:
        return self._spawn_spare(self._register_spare(node), node)

    def _register_spare(self, node: int) -> str:
        """A new spare id on ``node``, registered with the coordinator (which counts it as a spare
        that is still starting until it says it is ready)."""
        k = self._spare_counter.get(node, 0)
        self._spare_counter[node] = k + 1
        wid = control.spare_id(node, k)
        self.control.register_spare(wid, node)
        return wid

    def _spawn_spare(self, wid: str, node: int) -> Worker:
        worker_env = self._base_env(node)
        worker_env.update({env.HOTSPARE_ROLE: "spare", env.HOTSPARE_WORKER_ID: wid})
        for key in ("RANK", "LOCAL_RANK"):
            worker_env.pop(key, None)  # a spare learns its rank from its takeover order
        worker = Worker(wid, node, self._spawn(worker_env))
        self.workers[wid] = worker
        return worker

    def start(self) -> None:
        if self.spec.script[0] != "-m" and not os.path.isfile(self.spec.script[0]):
            raise ValueError(f"the training script {self.spec.script[0]!r} does not exist (looked from {os.getcwd()})")
        warn_stale_build_locks(extensions_root({**os.environ, **self.spec.extra_env}))
        # Decide DeepSpeed's accelerator once, here, so every worker agrees (DS_ACCELERATOR=cpu
        # when this node has no GPU; a user's own setting is kept).
        env.configure_accelerator()
        self.port = self._open_store()
        self._advertise()
        if self.spec.node_rank == 0:
            self.coordinator = Coordinator(self.spec, self.control, self.world_size, self.port)
        if self.spec.node_rank != 0:
            threading.Thread(target=self._beat, name="hotspare-node-heartbeat", daemon=True).start()
        _log(f"job {self.job_id}: node {self.spec.node_rank}/{self.spec.nnodes}, {self.spec.nproc_per_node} "
             f"workers + {self.spec.spares_per_node} spare(s) per node, store {self.spec.master_addr}:{self.port}")
        if self.spec.keeper:
            for node in self._local_nodes():
                self.keepers[node] = keeper.start(self.job_id, node, keeper.socket_path(self.job_id, node))
        if self.spec.spares_only:
            _log(f"node {self.spec.node_rank} joins job {self.job_id} with {self.spec.spares_per_node} spare(s) only")
        for local_rank in range(0 if self.spec.spares_only else self.spec.nproc_per_node):
            self._start_active(local_rank)
        for node in self._local_nodes():
            for _ in range(self.spec.spares_per_node):
                self._start_spare(node)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every worker: ``sig`` first, SIGKILL after the grace period."""
        self._stopping = True
        live = [w.proc for w in self.workers.values() if w.proc.poll() is None]
        for p in live:
            _signal_group(p, sig)
        deadline = time.monotonic() + self.spec.term_grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        # A worker may have left children in its session even after exiting.
        for w in self.workers.values():
            _signal_group(w.proc, signal.SIGKILL)
        self._stop_keepers()

    def _stop_keepers(self) -> None:
        """After the workers: each keeper removes its segments and exits (SIGKILL after the grace;
        the next keeper on the node then removes what that one left)."""
        for p in self.keepers.values():
            if p.poll() is None:
                p.terminate()
        for node, p in self.keepers.items():
            try:
                p.wait(timeout=self.spec.term_grace_s)
            except subprocess.TimeoutExpired:
                _log(f"the keeper of node {node} did not stop in {self.spec.term_grace_s} s; killing it")
                p.kill()
                p.wait()
            if p.returncode != 0:
                keeper.remove_cuda_ipc_files(p.pid)  # a device tier's driver files, which it could not remove
                # A killed keeper could not remove its socket either (a clean exit does).
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(keeper.socket_path(self.job_id, node))
        if self.keepers:
            # A keeper that was killed (its node "lost", in a test) left its segments.
            removed = keeper.remove_stale()
            if removed:
                _log(f"removed {len(removed)} segment(s) a killed keeper left: {', '.join(removed)}")

    # ---- watching --------------------------------------------------------------------------

    def _report(self, w: Worker, code: int, reason: str, detect_s: float = 0.0) -> None:
        """A failure of ``w`` to the coordinator: gone (then ``exited/<wid>`` too), or ``w.dying``
        (its exit began; ``exited/<wid>`` follows once it is gone, see :meth:`_watch`)."""
        if not w.dying:
            self._gone(w, code)
        failure = control.Failure(worker=w.wid, rank=w.rank, code=code, reason=reason, wall_time=time.time(),
                                  detect_s=detect_s)
        what = f"rank {w.rank}" if w.rank >= 0 else f"spare {w.wid}"
        how = {"exit": describe_exit(code), "heartbeat": f"no heartbeat for {detect_s:.1f} s, killed",
               "watchdog": f"stuck (its peers' collectives timed out waiting for it; {detect_s:.1f} s), killed"}[reason]
        _log(f"{what} ({w.wid}, node {w.node}) failed: {how}")
        self.control.report_failure(failure)

    def _gone(self, w: Worker, code: int) -> None:
        """A failed worker's process is gone: ``exited/<wid>`` (a spare taking its device waits for it).
        What it started in its session and left behind goes too (a killed trainer's helper
        processes, such as megatron-core's checkpoint manager, would otherwise live on)."""
        _signal_group(w.proc, signal.SIGKILL)
        w.finish()
        self.control.set_exited(w.wid, code)

    def _check_heartbeat(self, w: Worker, now: float) -> None:
        try:
            beat = self.control.beats(w.wid)
            timeout_s = self.control.beat_timeout(w.wid) if beat is not None and w.beat < 0 <= beat else None
        except control.BadMessage as exc:  # not the worker's own writing: no beat
            if w.wid not in self._bad_beats:
                self._bad_beats.add(w.wid)
                _log(f"{exc}; not counted as a heartbeat")
            return
        if beat is None:
            return
        if beat < 0:  # the worker said goodbye
            w.beat_timeout = 0.0
            return
        if beat != w.beat:
            if w.beat < 0:
                w.beat_timeout = timeout_s or 0.0
            w.beat, w.beat_seen = beat, now
        elif w.beat_timeout and now - w.beat_seen > w.beat_timeout:
            _signal_group(w.proc, signal.SIGKILL)
            w.proc.wait()
            self._report(w, w.proc.returncode, "heartbeat", detect_s=now - w.beat_seen)

    def _watch(self) -> None:
        for node, k in self.keepers.items():
            if node not in self._keepers_gone and not self._stopping and k.poll() is not None:
                self._keepers_gone.add(node)
                _log(f"the keeper of node {node} exited ({describe_exit(k.returncode)}): training goes on, but a spare "
                     f"that takes a rank of node {node} gets its state from the peers, not from this node's memory")
        kills, self._kill_read = self.control.kills(self._kill_read)
        for order in kills:
            w = self.workers.get(order.worker)
            if w is not None and not w.done:
                _log(f"worker {w.wid} is stuck; its threads' stacks follow")
                _dump_stacks(w.proc)
                _signal_group(w.proc, signal.SIGKILL)
                w.proc.wait()
                self._report(w, w.proc.returncode, "watchdog", detect_s=order.detect_s)
        now = time.monotonic()
        for w in list(self.workers.values()):
            if w.done:
                continue
            code = w.proc.poll()
            if code is None:
                early = None if self._stopping else w.exiting()
                if early is not None:
                    # Its exit began: report it now, not once its memory is torn down.
                    w.dying = True
                    self._report(w, early, "exit")
                elif not w.dying:
                    self._check_heartbeat(w, now)
            elif w.dying:
                self._gone(w, code)  # reported when its exit began
            elif code == 0 or self._stopping:
                w.finish()  # done, or stopped by this launcher: nothing to report
            else:
                self._report(w, code, "exit")

    def _follow_plans(self) -> None:
        """Apply every new plan: promoted spares of this node become ranks; start their successors."""
        while self.control.superseded(self.generation):
            plan = self.control.plan(self.generation + 1)
            self.generation = plan.generation
            if plan.abort:
                if self.exit_code is None:
                    self.exit_code = _plan_exit_code(plan)
                return
            for rank, wid in plan.replaced.items():
                w = self.workers.get(wid)
                if w is not None:
                    w.rank = int(rank)
                    successor = _Successor(self._register_spare(w.node), w.node, plan.generation,
                                           plan.failures_read, time.monotonic() + self.spec.successor_wait_s)
                    self._successors.append(successor)
                    _log(f"generation {plan.generation}: spare {wid} takes rank {rank}; its successor "
                         f"{successor.wid} on node {w.node} starts once the generation has caught up")

    def _start_successors(self) -> None:
        """Start the successors whose time has come: their generation (or a later one) is back at
        the step the failure interrupted, another failure was reported, or their wait ran out."""
        if not self._successors:
            return
        now = time.monotonic()
        failures = self.control.failure_count()
        for s in list(self._successors):
            caught_up = any(self.control.caught_up(g) for g in range(s.generation, self.generation + 1))
            why = ("the generation caught up" if caught_up else "another failure came" if failures > s.failures_read
                   else f"--successor-wait-s={self.spec.successor_wait_s} ran out" if now >= s.deadline else "")
            if why:
                self._successors.remove(s)
                self._spawn_spare(s.wid, s.node)
                _log(f"starting spare {s.wid} on node {s.node} ({why})")

    def wait(self) -> int:
        """Block until the job ends; return its exit code."""
        while True:
            self._watch()
            if self.coordinator is not None:
                self.coordinator.step()
            self._follow_plans()
            self._start_successors()
            aborted = self.control.abort_message() if self.exit_code is None else None
            if aborted is not None:
                _log(f"a worker stopped the job: {aborted}")
                self.exit_code = ABORT_EXIT_CODE
            if self.exit_code is not None:
                self.stop()
                return self.exit_code
            active = [w for w in self.workers.values() if w.rank >= 0 and not _failed(w)]
            self._release_spares()
            if not active and self.spec.spares_only and self._released and \
                    all(w.proc.poll() is not None for w in self.workers.values()):
                return 0  # a replacement node whose spares were not needed: released at the end
            if active and all(w.proc.poll() == 0 for w in active) and self._job_finished(active):
                # Training finished on every rank: release the spares (they wait for an order or this key).
                self.control.shut_down()
                self._release_spares()
                self._stopping = True
                deadline = time.monotonic() + self.spec.term_grace_s
                while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers.values()):
                    time.sleep(POLL_INTERVAL_S)
                self.stop()
                _log(f"job {self.job_id}: training finished on every rank; exit 0")
                return 0
            self._pause()

    def _job_finished(self, active: list) -> bool:
        """This node's ranks all finished (exit 0): say so (``finished/<rank>``), and tell whether
        the whole job has: node 0 once every rank said so, another node once node 0 said
        ``shutdown``. A launcher exits 0 for nothing less."""
        for w in active:
            if w.rank not in self._said_finished:
                self.control.set_finished(w.rank, w.wid)
                self._said_finished.add(w.rank)
        if self.spec.node_rank != 0:
            return self.control.is_shut_down()
        return all(self.control.finished(r) for r in range(self.world_size))

    def _release_spares(self) -> None:
        """Once training finished (any launcher set ``shutdown``): wake this node's waiting spares,
        which then see it and exit."""
        if self._released or not self.control.is_shut_down():
            return
        self._released = True
        for w in self.workers.values():
            if w.rank < 0 and not w.done:
                self.control.wake(w.wid)

    def _pause(self) -> None:
        """Until the next look: ``POLL_INTERVAL_S``, cut short the moment a worker exits (its
        pidfd turns readable); while a failure waits for its plan, ``control.RECOVERY_POLL_S``."""
        busy = self.coordinator is not None and self.coordinator.busy
        deadline = time.monotonic() + (control.RECOVERY_POLL_S if busy else POLL_INTERVAL_S)
        live = [w for w in self.workers.values() if not w.done]
        fds = [w.pidfd for w in live if w.pidfd >= 0]
        watched = [w for w in live if w.stat_fd >= 0 and not w.dying and not self._stopping]
        while (left := deadline - time.monotonic()) > 0:
            step = min(left, EXIT_POLL_S) if watched else left
            if fds:
                if select.select(fds, [], [], step)[0]:
                    return
            else:
                time.sleep(step)
            if any(w.exiting() is not None for w in watched):
                return

    def close(self) -> None:
        self._beat_stop.set()
        self.stop(signal.SIGKILL)
        for w in self.workers.values():
            w.finish()
        self.store = self.control = None


@dataclass
class _Successor:
    """A spare registered to follow one promoted in ``generation``, not started yet."""

    wid: str
    node: int
    generation: int
    failures_read: int
    """The plan's ``failures_read``: a failure beyond it needs this spare now."""
    deadline: float


def _failed(w: Worker) -> bool:
    code = w.proc.poll()
    return w.dying or (code is not None and code != 0)


def _plan_exit_code(plan: control.Plan) -> int:
    codes = [f["code"] for f in plan.failures] or [1]
    code = codes[0]
    return code if code > 0 else 128 - code


STACKS_WAIT_S = 1.0
"""At most this long for a stuck worker to take the signal that has it write its stacks."""


def _signal_pending(pid: int, sig: int) -> bool:
    """``sig`` sent to process ``pid`` and not yet taken by it (``ShdPnd`` of /proc/<pid>/status)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("ShdPnd:"):
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


STALE_LOCK_S = 600.0


def extensions_root(environ) -> str:
    """Where torch builds extensions for this interpreter (torch 2.13's
    ``cpp_extension._get_build_directory`` without its side effect of creating the directory;
    tests/test_launch.py pins the two together)."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return environ["TORCH_EXTENSIONS_DIR"]
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    folder = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accelerator}"
    return os.path.join(get_default_build_root(), folder)


def warn_stale_build_locks(root: str | None = None, now: float | None = None) -> list[str]:
    """torch's extension builds (DeepSpeed's ops) serialise on a ``lock`` file in each build
    directory, and a build killed midway leaves it: every later process that needs that op
    then waits for it silently, forever. A lock older than :data:`STALE_LOCK_S` is named with
    what to do (it cannot be told from a build still running elsewhere, so it is not removed).
    Returns the locks named."""
    root = extensions_root(os.environ) if root is None else root
    now = time.time() if now is None else now
    stale = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        lock = os.path.join(root, name, "lock")
        try:
            age = now - os.stat(lock).st_mtime
        except OSError:
            continue
        if age > STALE_LOCK_S:
            stale.append(lock)
            _log(f"warning: {lock} is {age / 60:.0f} min old: a build of the {name!r} op was killed midway, and any "
                 f"worker that needs that op will wait for it forever. If no build is running, remove it: rm {lock}")
    return stale


def _dump_stacks(p: subprocess.Popen) -> None:
    """Have a worker write its threads' stacks to its stderr (see control.STACKS_SIGNAL): send the
    signal, wait until the worker took it (a loaded machine may not run it at once), then give
    the handler a moment to write."""
    try:
        os.kill(p.pid, control.STACKS_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + STACKS_WAIT_S
    while _signal_pending(p.pid, control.STACKS_SIGNAL) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run(spec: LaunchSpec) -> int:
    """Launch, wait, and clean up; SIGINT/SIGTERM stop every worker before returning."""
    launcher = Launcher(spec)

    def on_signal(signum, _frame):
        _log(f"received {signal.Signals(signum).name}, stopping workers")
        launcher.stop(signal.SIGTERM)
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        return launcher.wait()
    finally:
        launcher.close()
        for s, h in old.items():
            signal.signal(s, h)


def listen_socket(addr: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``addr`` only (port 0: a free one)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on --master-addr {addr} port {port}: {exc} (is the address this "
                         f"machine's, and the port free?)") from None
    sock.listen(1024)
    sock.set_inheritable(False)
    return sock


def route_to(addr: str) -> str:
    """The local address this machine reaches ``addr`` from (a UDP connect: nothing is sent)."""
    family = socket.getaddrinfo(addr, 1, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 1))
            return s.getsockname()[0]
        except OSError:
            return addr


def interface_of(addr: str) -> str:
    """The name of the local interface that holds ``addr`` ('' when none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    return ""


def parse_args(argv: list[str] | None = None) -> LaunchSpec:
    p = argparse.ArgumentParser(prog="hotspare-run", description=__doc__.split("\n\n")[0])
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=0)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="HOST:PORT of the control store; overrides --master-addr/--master-port")
    p.add_argument("--logical-nodes", type=int, default=1)
    p.add_argument("--spares-per-node", "--spares_per_node", type=int, default=0)
    p.add_argument("--job-id", default="")
    p.add_argument("--store-timeout", type=float, default=60.0)
    p.add_argument("--stall-grace-s", type=float, default=5.0,
                   help="seconds every active worker has to report a failure its peers saw (or, at least, to "
                        "leave a failed generation) before it is killed as stuck")
    p.add_argument("--no-keeper", action="store_true",
                   help="start no keeper (ranks retain nothing outside their own processes)")
    p.add_argument("--spares-only", action="store_true",
                   help="join a running job as a replacement node that brings spares only (--node-rank >= "
                        "--nnodes, the job's --master-addr/--master-port)")
    p.add_argument("--spare-wait-s", type=float, default=0.0,
                   help="when more ranks fail than spares are ready, wait this long for spares (e.g. from a "
                        "--spares-only launcher) before stopping the job; 0: stop at once")
    p.add_argument("--node-timeout-s", type=float, default=10.0,
                   help="with --nnodes > 1: node 0 declares a node lost when its launcher is silent this long, "
                        "and a launcher cut off from the store this long stops its workers")
    p.add_argument("--successor-wait-s", type=float, default=30.0,
                   help="after a takeover, start the promoted spare's successor once the recovered generation "
                        "is back at the interrupted step, when another failure comes, or after this many "
                        "seconds at most (its warm-up then does not compete with the recovery); 0: at once")
    p.add_argument("--advertise-addr", default="",
                   help="this node's address for the workers' collectives (default: the one that reaches "
                        "--master-addr); its interface becomes GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME")
    p.add_argument("--job-secret-file", default=os.environ.get("HOTSPARE_JOB_SECRET_FILE", ""),
                   help="the job secret that signs the control store's messages: the same owner-only file on "
                        "every node (required with --nnodes > 1 or --spares-only; default: "
                        "$HOTSPARE_JOB_SECRET_FILE; one machine: made by node 0)")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    addr, port = a.master_addr, a.master_port
    if a.rdzv_endpoint:
        addr, _, port_s = a.rdzv_endpoint.rpartition(":")
        if not addr or not port_s.isdigit():
            p.error(f"--rdzv-endpoint={a.rdzv_endpoint!r} must be HOST:PORT")
        port = int(port_s)
    script = (["-m"] if a.module else []) + [a.script, *a.script_args]
    return LaunchSpec(script=script, nproc_per_node=a.nproc_per_node, nnodes=a.nnodes, node_rank=a.node_rank,
                      master_addr=addr, master_port=port, logical_nodes=a.logical_nodes,
                      spares_per_node=a.spares_per_node, job_id=a.job_id,
                      store_timeout_s=a.store_timeout, stall_grace_s=a.stall_grace_s, keeper=not a.no_keeper,
                      advertise_addr=a.advertise_addr, node_timeout_s=a.node_timeout_s, spares_only=a.spares_only,
                      spare_wait_s=a.spare_wait_s, successor_wait_s=a.successor_wait_s,
                      job_secret_file=a.job_secret_file)


def main(argv: list[str] | None = None) -> int:
    try:
        spec = parse_args(argv)
        spec.validate()
    except ValueError as exc:
        _log(f"error: {exc}")
        return 2
    try:
        return run(spec)
    except (ValueError, ConnectionError) as exc:  # the store's address, another job's store
        _log(f"error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
