"""What one launcher starts: ``LaunchSpec``, its checks, and its command line (:mod:`.cli`)."""
from __future__ import annotations

import math
import re
import socket
from dataclasses import dataclass, field

JOB_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""What a ``--job-id`` may be: it names shared-memory segments and sockets."""


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
    """Job identifier (shared-memory, socket and log names): 1 to 64 of ``A-Z a-z 0-9 _ . -``;
    random when empty."""
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
        for flag, addr in (("--master-addr", self.master_addr), ("--advertise-addr", self.advertise_addr)):
            try:
                if addr:
                    socket.getaddrinfo(addr, None)
            except (OSError, UnicodeError) as exc:
                raise ValueError(f"{flag}={addr!r} does not resolve ({exc})") from None
        if self.job_id and not JOB_ID.fullmatch(self.job_id):
            raise ValueError(f"--job-id={self.job_id[:80]!r} must be 1 to 64 of the characters A-Z a-z 0-9 _ . - (it "
                             f"names the job's shared-memory segments and sockets)")
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
