"""hotspare-run: the per-node launcher.

It mirrors torchrun's flags, starts this node's workers, and owns the control store
(a TCPStore on node 0) so the store outlives any worker. Workers get torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
plus the ``HOTSPARE_*`` variables of :mod:`hotspare.env`.

``--logical-nodes L`` splits one machine's workers into L logical nodes (for tests and
recipes that need "other nodes" on one host); each worker's HOTSPARE_NODE_RANK is its
logical node.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from . import env

POLL_INTERVAL_S = 0.05


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
    job_id: str = ""
    """Job identifier (shared-memory and log names); random when empty."""
    store_timeout_s: float = 60.0
    """How long workers wait to reach the store; also the store's own timeout."""
    term_grace_s: float = 10.0
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Added to every worker's environment."""

    def validate(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node={self.nproc_per_node} must be at least 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in [0, --nnodes={self.nnodes})")
        if self.logical_nodes < 1:
            raise ValueError(f"--logical-nodes={self.logical_nodes} must be at least 1")
        if self.logical_nodes > 1 and self.nnodes > 1:
            raise ValueError("--logical-nodes splits one machine; use it only with --nnodes=1")
        if self.nproc_per_node % self.logical_nodes:
            raise ValueError(f"--nproc-per-node={self.nproc_per_node} is not divisible by "
                             f"--logical-nodes={self.logical_nodes}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("--master-port is required when --nnodes > 1 (every launcher must find the store)")
        if not self.script:
            raise ValueError("no training script given")


def _log(msg: str) -> None:
    print(f"[hotspare-run] {msg}", file=sys.stderr, flush=True)


class Launcher:
    """Starts and watches this node's workers."""

    def __init__(self, spec: LaunchSpec):
        spec.validate()
        self.spec = spec
        self.job_id = spec.job_id or uuid.uuid4().hex[:12]
        self.store = None
        self.procs: dict[int, subprocess.Popen] = {}
        self._stopping = False

    @property
    def world_size(self) -> int:
        return self.spec.nnodes * self.spec.nproc_per_node

    def _open_store(self) -> int:
        import torch.distributed as dist

        if self.spec.node_rank != 0:
            return self.spec.master_port
        self.store = dist.TCPStore(self.spec.master_addr, self.spec.master_port, is_master=True,
                                   timeout=datetime.timedelta(seconds=self.spec.store_timeout_s),
                                   wait_for_workers=False)
        return self.store.port

    def _worker_env(self, local_rank: int, port: int) -> dict[str, str]:
        s = self.spec
        rank = s.node_rank * s.nproc_per_node + local_rank
        if s.logical_nodes > 1:
            node, num_nodes = local_rank // (s.nproc_per_node // s.logical_nodes), s.logical_nodes
        else:
            node, num_nodes = s.node_rank, s.nnodes
        worker_env = dict(os.environ)
        worker_env.update(s.extra_env)
        worker_env.update({
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(s.nproc_per_node), "MASTER_ADDR": s.master_addr, "MASTER_PORT": str(port),
            env.HOTSPARE_STORE_HOST: s.master_addr, env.HOTSPARE_STORE_PORT: str(port),
            env.HOTSPARE_NODE_RANK: str(node), env.HOTSPARE_NUM_NODES: str(num_nodes),
            env.HOTSPARE_JOB_ID: self.job_id, env.HOTSPARE_GENERATION: "0",
            env.HOTSPARE_STORE_TIMEOUT_S: str(s.store_timeout_s),
        })
        return worker_env

    def start(self) -> None:
        # Decide DeepSpeed's accelerator once, here, so every worker agrees (DS_ACCELERATOR=cpu
        # when this node has no GPU; a user's own setting is kept).
        env.configure_accelerator()
        port = self._open_store()
        _log(f"job {self.job_id}: node {self.spec.node_rank}/{self.spec.nnodes}, {self.spec.nproc_per_node} "
             f"workers, store {self.spec.master_addr}:{port}")
        for local_rank in range(self.spec.nproc_per_node):
            worker_env = self._worker_env(local_rank, port)
            # Own session per worker, so stopping one also stops whatever it spawned.
            self.procs[int(worker_env["RANK"])] = subprocess.Popen(
                [sys.executable, *self.spec.script], env=worker_env, start_new_session=True)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every worker: ``sig`` first, SIGKILL after the grace period."""
        self._stopping = True
        live = [p for p in self.procs.values() if p.poll() is None]
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
        for p in self.procs.values():
            _signal_group(p, signal.SIGKILL)

    def wait(self) -> int:
        """Block until every worker exits; return the job's exit code."""
        while True:
            codes = {rank: p.poll() for rank, p in self.procs.items()}
            failed = {r: c for r, c in codes.items() if c not in (None, 0)}
            if failed and not self._stopping:
                rank, code = min(failed.items())
                _log(f"rank {rank} exited with code {code} ({_describe(code)}); this launcher has no "
                     f"spare to replace it, stopping the other workers")
                self.stop()
                return code if code > 0 else 128 - code
            if all(c is not None for c in codes.values()):
                return max((c if c >= 0 else 128 - c for c in codes.values()), default=0)
            time.sleep(POLL_INTERVAL_S)

    def close(self) -> None:
        self.stop(signal.SIGKILL)
        self.store = None


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "error exit"


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
    p.add_argument("--job-id", default="")
    p.add_argument("--store-timeout", type=float, default=60.0)
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
                      master_addr=addr, master_port=port, logical_nodes=a.logical_nodes, job_id=a.job_id,
                      store_timeout_s=a.store_timeout)


def main(argv: list[str] | None = None) -> int:
    try:
        spec = parse_args(argv)
        spec.validate()
    except ValueError as exc:
        _log(f"error: {exc}")
        return 2
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
