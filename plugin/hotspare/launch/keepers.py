"""The keepers one launcher runs, one per (logical) node (:mod:`hotspare.keeper`): started before
the workers, watched while they run, stopped after them."""
from __future__ import annotations

import contextlib
import os
import subprocess
import time

from .. import keeper
from ..coordinator import describe_exit
from .processes import log


class Keepers:
    def __init__(self, job_id: str):
        self.job_id = job_id
        self.procs: dict[int, subprocess.Popen] = {}  # (logical) node -> its keeper
        self._gone: set[int] = set()  # nodes whose keeper exited while the job ran (said once)
        self.released: set[int] = set()  # nodes drained: their keeper was stopped on purpose

    def __contains__(self, node: int) -> bool:
        return node in self.procs

    def start(self, node: int) -> None:
        self.procs[node] = keeper.start(self.job_id, node, self.socket_path(node))

    def socket_path(self, node: int) -> str:
        return keeper.socket_path(self.job_id, node)

    def watch(self) -> None:
        """Say once that a keeper exited while the job runs."""
        for node, k in self.procs.items():
            if node not in self._gone and node not in self.released and k.poll() is not None:
                self._gone.add(node)
                log(f"the keeper of node {node} exited ({describe_exit(k.returncode)}): training goes on, but a spare "
                    f"that takes a rank of node {node} gets its state from the peers, not from this node's memory")

    def stop(self, grace_s: float) -> None:
        """After the workers (or when fencing): each keeper removes its segments and exits;
        SIGKILL to those still there ``grace_s`` after the SIGTERM (one grace for all of them),
        and this launcher removes what a killed one left."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for node, p in self.procs.items():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"the keeper of node {node} did not stop in {grace_s} s; killing it")
                p.kill()
                p.wait()
            if p.returncode != 0:
                keeper.remove_cuda_ipc_files(p.pid)  # a device tier's driver files, which it could not remove
                # A killed keeper could not remove its socket either (a clean exit does).
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path(node))
        if self.procs:
            # A keeper that was killed (its node "lost", in a test) left its segments.
            removed = keeper.remove_stale()
            if removed:
                log(f"removed {len(removed)} segment(s) a killed keeper left: {', '.join(removed)}")
