"""The launcher of one node: its workers, spares and keepers, heartbeats and fencing, the
coordinator on node 0, the spares' successors, the job's end."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid

from .. import control, env
from ..control import auth
from ..coordinator import Coordinator, describe_exit
from .buildlocks import clear_stale_build_locks, extensions_root
from .draining import Drained, Orders
from .exits import ABORT_EXIT_CODE, BAD_CONTROL_EXIT_CODE, FENCED_EXIT_CODE, UNEXPECTED_EXIT_CODE, plan_exit_code, say_exit
from .fencing import NodeBeat, fence
from .keepers import Keepers
from .network import interface_of, route_to
from .processes import Worker, log, pause, signal_group, spawn, worker_env
from .spec import LaunchSpec
from .store import open_store
from .successors import Successors

POLL_INTERVAL_S = 0.02
__all__ = ["POLL_INTERVAL_S", "ABORT_EXIT_CODE", "BAD_CONTROL_EXIT_CODE", "FENCED_EXIT_CODE", "Launcher", "run"]


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
        self.exit_cause = ""
        """Why the launcher ends with ``exit_code`` (its last line says both)."""
        self._fencing = threading.Lock()
        self._spare_counter: dict[int, int] = {}
        self._stopping = False
        self._released = False  # spares woken to see "shutdown"
        self.orders = Orders()  # the coordinator's kills and handovers for this launcher's workers
        self.drained = Drained()  # this launcher's nodes that an operator drained (launch/draining.py)
        self._bad_beats: set[str] = set()  # workers whose heartbeat key held something else (said once)
        self._said_finished: set[int] = set()  # this node's ranks written to finished/<rank>
        self.keepers = Keepers(self.job_id)
        self.coordinator: Coordinator | None = None  # node 0 only
        self._node_beat: NodeBeat | None = None  # nodes other than 0
        self._fingerprint: str | None = None  # node 0: the job's, once a worker claimed it
        self._identity_due = 0.0
        self.successors = Successors(self.spec.successor_wait_s, lambda: self.control, self._spawn_spare)

    @property
    def world_size(self) -> int:
        return self.spec.nnodes * self.spec.nproc_per_node

    def open_store(self) -> int:
        """Node 0: start the control store and publish the job's id; another node: join it and take
        the job's id (:func:`store.open_store`). Returns the store's port."""
        self.store, self.control, self.signer, port = open_store(self.spec, self.signer)
        self.job_id = self.keepers.job_id = self.signer.job_id
        return port

    def _fence(self, silent_s: float, why: str = "") -> None:
        """This node lost the control store (:func:`.fencing.fence`; the heartbeat watch thread
        or the main loop, whichever sees it first)."""
        if not self._fencing.acquire(blocking=False):
            threading.Event().wait()  # the other thread is fencing, and exits the process
        fence(self.spec, self.workers.values(), self.keepers, silent_s, why)

    def _advertise(self) -> None:
        """The address this node's workers talk from, and its interface: gloo (and NCCL's
        bootstrap) are told to use it, so no collective traffic goes out another network."""
        s = self.spec
        self.advertise_addr = s.advertise_addr or route_to(s.master_addr)
        self.advertise_ifname = interface_of(self.advertise_addr)
        where = f"interface {self.advertise_ifname}" if self.advertise_ifname else "no local interface has it"
        log(f"node {s.node_rank} advertises {self.advertise_addr} ({where})")

    @property
    def num_nodes(self) -> int:
        """(Logical) nodes of the job."""
        return self.spec.logical_nodes if self.spec.logical_nodes > 1 else self.spec.nnodes

    def _local_nodes(self) -> list[int]:
        s = self.spec
        return list(range(s.logical_nodes)) if s.logical_nodes > 1 else [s.node_rank]

    def _base_env(self, node: int) -> dict[str, str]:
        return worker_env(self.spec, self.world_size, self.num_nodes, self.port, self.job_id, self.signer,
                          self.advertise_ifname, self.keepers.socket_path(node) if node in self.keepers else "",
                          node)

    def _spawn(self, wenv: dict[str, str]) -> subprocess.Popen:
        return spawn(self.spec.script, wenv)

    def _start_active(self, local_rank: int) -> None:
        rank = self.spec.node_rank * self.spec.nproc_per_node + local_rank
        wid = control.active_id(rank)
        node = self.spec.node_of_rank(rank)
        wenv = self._base_env(node)
        wenv.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank), env.HOTSPARE_ROLE: "active",
                           env.HOTSPARE_WORKER_ID: wid})
        self.workers[wid] = Worker(wid, node, self._spawn(wenv), rank=rank)

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
        wenv = self._base_env(node)
        wenv.update({env.HOTSPARE_ROLE: "spare", env.HOTSPARE_WORKER_ID: wid})
        for key in ("RANK", "LOCAL_RANK"):
            wenv.pop(key, None)  # a spare learns its rank from its takeover order
        worker = Worker(wid, node, self._spawn(wenv))
        self.workers[wid] = worker
        return worker

    def start(self) -> None:
        if self.spec.script[0] != "-m" and not os.path.isfile(self.spec.script[0]):
            raise ValueError(f"the training script {self.spec.script[0]!r} does not exist (looked from {os.getcwd()})")
        clear_stale_build_locks(extensions_root({**os.environ, **self.spec.extra_env}))
        # Decide DeepSpeed's accelerator once, here, so every worker agrees (DS_ACCELERATOR=cpu
        # when this node has no GPU; a user's own setting is kept).
        env.configure_accelerator()
        self.port = self.open_store()
        self._advertise()
        if self.spec.node_rank == 0:
            self.coordinator = Coordinator(self.spec, self.control, self.world_size, self.port)
        if self.spec.node_rank != 0:
            self._node_beat = NodeBeat(self.spec, self.signer, self._fence)
            self._node_beat.start()
        log(f"job {self.job_id}: node {self.spec.node_rank}/{self.spec.nnodes}, {self.spec.nproc_per_node} "
             f"workers + {self.spec.spares_per_node} spare(s) per node, store {self.spec.master_addr}:{self.port}")
        if self.spec.keeper:
            for node in self._local_nodes():
                self.keepers.start(node)
        if self.spec.spares_only:
            log(f"node {self.spec.node_rank} joins job {self.job_id} with {self.spec.spares_per_node} spare(s) only")
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
            signal_group(p, sig)
        deadline = time.monotonic() + self.spec.term_grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(p, signal.SIGKILL)
                p.wait()
        # A worker may have left children in its session even after exiting.
        for w in self.workers.values():
            signal_group(w.proc, signal.SIGKILL)
        self.keepers.stop(self.spec.term_grace_s)

    # ---- watching --------------------------------------------------------------------------

    def report(self, w: Worker, code: int, reason: str, detect_s: float = 0.0) -> None:
        """A failure of ``w`` to the coordinator: gone (then ``exited/<wid>`` too), or ``w.dying``
        (its exit began; ``exited/<wid>`` follows once it is gone, see :meth:`_watch`)."""
        if not w.dying:
            self._gone(w, code)
        failure = control.Failure(worker=w.wid, rank=w.rank, code=code, reason=reason, wall_time=time.time(),
                                  detect_s=detect_s)
        what = f"rank {w.rank}" if w.rank >= 0 else f"spare {w.wid}"
        how = {"exit": describe_exit(code), "heartbeat": f"no heartbeat for {detect_s:.1f} s, killed",
               "watchdog": f"stuck (its peers' collectives timed out waiting for it; {detect_s:.1f} s), killed",
               "handover": "handed over at a step boundary"}[reason]
        log(f"{what} ({w.wid}, node {w.node}) {'left' if reason == 'handover' else 'failed'}: {how}")
        self.control.report_failure(failure)

    def _gone(self, w: Worker, code: int) -> None:
        """A failed worker's process is gone: ``exited/<wid>`` (a spare taking its device waits for it).
        What it started in its session and left behind goes too (a killed trainer's helper
        processes, such as megatron-core's checkpoint manager, would otherwise live on)."""
        signal_group(w.proc, signal.SIGKILL)
        w.finish()
        self.control.set_exited(w.wid, code)

    def _check_heartbeat(self, w: Worker, now: float) -> None:
        try:
            beat = self.control.beats(w.wid)
            # Its timeout, read when a new beat (past the last counted) comes while none is set.
            fresh = beat is not None and beat > w.beat and not w.beat_timeout
            timeout_s = self.control.beat_timeout(w.wid) if fresh else None
        except control.BadMessage as exc:  # not the worker's own writing: no beat
            if w.wid not in self._bad_beats:
                self._bad_beats.add(w.wid)
                log(f"{exc}; not counted as a heartbeat")
            return
        silent = w.heard(beat, timeout_s, now)
        if silent is not None:
            signal_group(w.proc, signal.SIGKILL)
            w.proc.wait()
            self.report(w, w.proc.returncode, "heartbeat", detect_s=silent)

    def _watch(self) -> None:
        if not self._stopping:
            self.keepers.watch()
            self.drained.look(self)
            if self.coordinator is not None and time.monotonic() >= self._identity_due:
                self._identity_due = time.monotonic() + 1.0  # put back what a stranger wrote over, within 1 s
                self._fingerprint = self.control.guard_identity(self.job_id, self._fingerprint)
        self.orders.carry_out(self)
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
                    self.report(w, early, w.reason(early))
                elif not w.dying:
                    self._check_heartbeat(w, now)
            elif w.dying:
                self._gone(w, code)  # reported when its exit began
            elif code == 0 or self._stopping:
                w.finish()  # done, or stopped by this launcher: nothing to report
            else:
                self.report(w, code, w.reason(code))

    def _follow_plans(self) -> None:
        """Apply every new plan: promoted spares of this node become ranks; start their successors."""
        while self.control.superseded(self.generation):
            plan = self.control.plan(self.generation + 1)
            self.generation = plan.generation
            if plan.abort:
                if self.exit_code is None:
                    self.exit_code = plan_exit_code(plan.failures)
                    self.exit_cause = f"the job stopped in generation {plan.generation}: {plan.abort}"
                    if self.spec.node_rank != 0:  # node 0's coordinator said it already
                        log(f"the coordinator stopped the job: {plan.abort}")
                return
            for rank, wid in plan.replaced.items():
                w = self.workers.get(wid)
                if w is not None:
                    w.rank = int(rank)
                    successor = self.successors.register(self._register_spare(w.node), w.node, plan)
                    log(f"generation {plan.generation}: spare {wid} takes rank {rank}; its successor "
                         f"{successor} on node {w.node} starts once the generation has caught up")

    def wait(self) -> int:
        """Block until the job ends; return its exit code."""
        while True:
            try:
                self._watch()
                if self.coordinator is not None:
                    self.coordinator.step()
                self._follow_plans()
                self.successors.start_due(self.generation)
            except control.BadMessage as exc:  # signed by the job, but not what the key holds: a bug
                log(f"error: {exc}; this launcher cannot follow the job's plans with it: stopping its workers "
                    f"(exit {BAD_CONTROL_EXIT_CODE})")
                self.exit_code = BAD_CONTROL_EXIT_CODE
                self.exit_cause = f"a control value signed by the job is not what its key holds (a bug): {exc}"
            except Exception as exc:  # noqa: BLE001 - re-raised unless it is the store lost
                if self.spec.node_rank == 0 or not _store_lost(exc):
                    raise  # node 0's store is its own: never lost
                self._fence(0.0, why=f"(its connection failed: {str(exc).splitlines()[0][:200]}; node 0's "
                                     f"launcher is gone or cut off)")
            aborted = self.control.abort_message() if self.exit_code is None else None
            if aborted is not None:
                log(f"a worker stopped the job: {aborted}")
                self.exit_code, self.exit_cause = ABORT_EXIT_CODE, f"a worker stopped the job: {aborted}"
            if self.exit_code is not None:
                self.stop()
                return self.exit_code
            active = [w for w in self.workers.values() if w.rank >= 0 and not _failed(w)]
            self._release_spares()
            if not active and self.spec.spares_only and self._released and \
                    all(w.proc.poll() is not None for w in self.workers.values()):
                # A replacement node whose spares were not needed: released at the end.
                self.exit_cause = f"training finished; node {self.spec.node_rank}'s spares were not needed"
                return 0
            if active and all(w.proc.poll() == 0 for w in active) and self._job_finished(active):
                # Training finished on every rank: release the spares (they wait for an order or this key).
                self.control.shut_down()
                self._release_spares()
                self._stopping = True
                deadline = time.monotonic() + self.spec.term_grace_s
                while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers.values()):
                    time.sleep(POLL_INTERVAL_S)
                self.stop()
                self.exit_cause = f"job {self.job_id}: training finished on all {self.world_size} ranks"
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
        """Until the next look: ``POLL_INTERVAL_S``; while a failure waits for its plan,
        ``control.RECOVERY_POLL_S``; cut short by a worker's exit."""
        busy = self.coordinator is not None and self.coordinator.busy
        pause(self.workers.values(), control.RECOVERY_POLL_S if busy else POLL_INTERVAL_S, self._stopping)

    def close(self) -> None:
        if self._node_beat is not None:
            self._node_beat.stop()
        self.stop(signal.SIGKILL)
        for w in self.workers.values():
            w.finish()
        self.store = self.control = None


def _store_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is the control store's connection failing (torch's store errors)."""
    import torch.distributed as dist

    return isinstance(exc, (ConnectionError, dist.DistNetworkError, dist.DistStoreError))


def _failed(w: Worker) -> bool:
    code = w.proc.poll()
    return w.dying or (code is not None and code != 0)


def run(spec: LaunchSpec) -> int:
    """Launch, wait, and clean up; SIGINT/SIGTERM stop every worker before returning. Its last
    line says the exit code and why; an exception (a refused spec, or unexpected) propagates once
    everything stopped, and :func:`.cli.main` prints that line after it."""
    launcher = Launcher(spec)

    def on_signal(signum, _frame):
        log(f"received {signal.Signals(signum).name}, stopping workers")
        launcher.exit_cause = f"received {signal.Signals(signum).name}: stopped every worker"
        launcher.stop(signal.SIGTERM)
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        code = launcher.wait()
    except SystemExit as exc:  # a signal (on_signal)
        code = exc.code if isinstance(exc.code, int) else UNEXPECTED_EXIT_CODE
    finally:
        launcher.close()
        for s, h in old.items():
            signal.signal(s, h)
    say_exit(code, launcher.exit_cause)
    return code
