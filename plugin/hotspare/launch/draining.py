"""Orders a launcher carries out for the coordinator or an operator: kill a stuck worker, hand a
worker's rank over (:class:`Orders`); drain a node (:mod:`hotspare.drain`): ``hotspare-run drain``,
the operator's command, and what a launcher does once the coordinator says one of its nodes is
free (``drained/<n>``): the node's spares, pending successors and keeper end, and nothing of the
job runs there."""
from __future__ import annotations

import argparse
import signal
import time

from .. import control
from ..control import auth
from .exits import BAD_LAUNCH_EXIT_CODE, say_exit
from .processes import dump_stacks, log, signal_group

LOOK_S = 0.5
"""How often a launcher looks for its nodes' ``drained/<n>``, and the drain command for its node's."""


class Orders:
    """The coordinator's kills (a stuck worker) and handovers (a straggler, a drain) for this
    launcher's workers."""

    def __init__(self) -> None:
        self.kills = control.ListCursor(control.keys.KILL)
        self.handovers = control.ListCursor(control.keys.HANDOVER)

    def carry_out(self, launcher) -> None:
        for order in launcher.control.kills(self.kills)[0]:
            w = launcher.workers.get(order.worker)
            if w is not None and not w.done:
                log(f"worker {w.wid} is stuck; its threads' stacks follow")
                dump_stacks(w.proc)
                signal_group(w.proc, signal.SIGKILL)
                w.proc.wait()
                launcher.report(w, w.proc.returncode, "watchdog", detect_s=order.detect_s)
        for order in launcher.control.handovers(self.handovers)[0]:
            if order.worker in launcher.workers:
                launcher.workers[order.worker].hand_over(order)


class Drained:
    """A launcher's watch for its drained nodes."""

    def __init__(self) -> None:
        self.nodes: set[int] = set()
        self._next = 0.0

    def look(self, launcher) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + LOOK_S
        mine = {w.node for w in launcher.workers.values()} | set(launcher.keepers.procs)
        for node in sorted(mine - self.nodes):
            if launcher.control.drained(node):
                self.nodes.add(node)
                release(launcher, node)


def release(launcher, node: int) -> None:
    """Node ``node`` runs no rank any more: its spares (waiting for an order), their pending
    successors and its keeper end."""
    launcher.successors.pending = [s for s in launcher.successors.pending if s.node != node]
    spares = [w for w in launcher.workers.values() if w.node == node and w.rank < 0 and not w.done]
    for w in spares:
        w.finish()  # ended on purpose: not a failure
        signal_group(w.proc, signal.SIGKILL)
        w.proc.wait()
    keeper = launcher.keepers.procs.get(node)
    if keeper is not None and keeper.poll() is None:
        keeper.terminate()
        launcher.keepers.released.add(node)
    log(f"node {node} is drained: {len(spares)} spare(s){' and its keeper' if keeper is not None else ''} "
        f"stopped; no process of the job runs there")


def main(argv: list[str]) -> int:
    """``hotspare-run drain --master-addr A --master-port P --job-secret-file F (--node N | --rank R)``."""
    from ..generation import connect_store

    p = argparse.ArgumentParser(prog="hotspare-run drain", description="Move every rank of a running job off a "
                                "(logical) node to spares on other nodes, without stopping the job; wait until the "
                                "node is free.")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--job-secret-file", required=True,
                   help="the job's secret (the file every node's hotspare-run was given): only the job may act")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--node", type=int, help="the (logical) node to drain: every rank on it moves to spares "
                       "on other nodes")
    which.add_argument("--rank", type=int, help="the rank to move to a spare (at its next step boundary)")
    p.add_argument("--wait-s", type=float, default=600.0, help="how long to wait for the node to be free (0: do "
                   "not wait)")
    try:
        a = p.parse_args(argv)
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        say_exit(BAD_LAUNCH_EXIT_CODE, "refused: the command line (argparse's message above)")
        return BAD_LAUNCH_EXIT_CODE
    problems = []
    if not 0 < a.master_port < 65536:
        problems.append(f"--master-port {a.master_port} must be in 1..65535")
    if a.node is not None and a.node < 0:
        problems.append(f"--node {a.node} must be >= 0")
    if a.rank is not None and a.rank < 0:
        problems.append(f"--rank {a.rank} must be >= 0")
    if not a.wait_s >= 0:
        problems.append(f"--wait-s {a.wait_s} must be >= 0 (seconds)")
    if problems:
        say_exit(BAD_LAUNCH_EXIT_CODE, f"refused: {'; '.join(problems)}")
        return BAD_LAUNCH_EXIT_CODE
    try:
        signer = auth.Signer(auth.read_secret_file(a.job_secret_file), "")
        store = connect_store(a.master_addr, a.master_port, 30.0)
        job = control.ControlStore(store, signer).job_id()
    except (ValueError, ConnectionError, auth.SecretError, control.BadMessage) as exc:
        say_exit(BAD_LAUNCH_EXIT_CODE, f"refused: {exc}")
        return BAD_LAUNCH_EXIT_CODE
    if job is None:
        say_exit(BAD_LAUNCH_EXIT_CODE, f"refused: the control store at {a.master_addr}:{a.master_port} serves no job "
                                       f"signed with {a.job_secret_file} (another job's secret, or none yet)")
        return BAD_LAUNCH_EXIT_CODE
    plane = control.ControlStore(store, signer.for_job(job))
    what = f"node {a.node}" if a.node is not None else f"rank {a.rank}"
    before = plane.moved(a.rank) if a.rank is not None else None
    plane.ask_drain(node=-1 if a.node is None else a.node, rank=-1 if a.rank is None else a.rank)
    log(f"job {job}: drain of {what} asked")
    deadline = time.monotonic() + a.wait_s

    def done() -> str | None:
        if a.node is not None:
            return f"node {a.node} is free" if plane.drained(a.node) else None
        outcome = plane.moved(a.rank)
        return None if outcome in (None, before) else f"rank {a.rank}: {outcome}"

    try:
        while a.wait_s > 0 and (said := done()) is None:
            if time.monotonic() > deadline:
                say_exit(1, f"{what} has not moved after {a.wait_s:g} s: no spare could take it yet (see node 0's "
                            f"hotspare-run log); the drain goes on")
                return 1
            time.sleep(LOOK_S)
    except (RuntimeError, ConnectionError) as exc:  # torch's DistNetworkError: the store is gone
        say_exit(1, f"the job's control store went away before {what} moved (the job ended; see node 0's "
                    f"hotspare-run log): {str(exc).splitlines()[0][:200]}")
        return 1
    if a.wait_s <= 0:
        said = f"drain of {what} asked"
    code = BAD_LAUNCH_EXIT_CODE if "refused:" in said else 0
    say_exit(code, said)
    return code
