"""The fault catalogue: every failure the fault matrix, the tests and the benchmarks inject, armed
deterministically by (kind, phase, rank, step).

A fault is written ``KIND@PHASE:RANK:STEP[:MICRO]``, for instance ``kill@backward:1:5`` (rank 1
is SIGKILLed in the backward of step 5's first micro-batch) or ``hang@recovery:spare:3`` (the
spare that takes a rank at the failure of step 3 stops while it joins the new generation).
``RANK`` is an active rank or ``spare`` (whichever process started as a spare and took a rank).
Only the process that started as the rank (worker ``a<RANK>``) fires a rank's fault, once: the
spare that replaces it trains on unharmed.

Kinds (:data:`KINDS`) and the phases each applies to (:data:`PHASES_OF`):

- ``kill``: SIGKILL (a crash, an OOM kill); ``segv``: SIGSEGV (a native crash; the launcher's
  ``PYTHONFAULTHANDLER`` prints the stack); ``exception``: a Python exception on that rank only (a
  bug; not a distributed error, so it is re-raised and the process exits with it, and its peers
  recover from the exit); ``hang``: SIGSTOP (found by missed heartbeats). Every phase.
- ``node``: the rank's whole logical node: its keeper, its spares, then the rank. Every phase.
- ``corrupt``: after the step's mirror round, one byte of every copy of the rank's state in one
  tier is flipped, then the rank is SIGKILLed: ``mirror`` flips what its holders hold (full copies
  or stripe shares, both versions), ``keeper`` what its node's keeper retains. Recovery must find
  it by the checksums and take the other tier.
- ``slow``: phase ``mirror``: the rank's mirror transfer of that step stalls (``SLOW_S``) past the
  in-flight window after a few messages, and the rank is SIGKILLed in it: its holders never commit
  that version. Phase ``forward``, written ``slow@forward:RANK:STEP:FACTOR``: from that step on,
  each forward of the rank takes FACTOR times as long (it sleeps FACTOR-1 times what its forward
  computed): a straggler, for the handover (the spare that takes its rank is not slowed).

Phases (:data:`PHASES`): ``forward`` (the forward of micro-batch MICRO), ``backward`` (when the
gradient reaches the model's first block: the later layers' buckets are reduced already, the rest
not), ``step`` (the optimizer step: after the backward, before the update), ``mirror`` (inside the
step's mirror or stripe transfer, after the header and two chunks), ``keeper`` (inside the keeper
transaction: between chunk 0's and chunk 1's commit records), ``recovery`` (while the rank joins
the first recovery's generation: a failure during a recovery already in progress; something else
must fail first, which the fault matrix arranges).

A worker builds an :class:`Injector` after ``initialize`` and calls it at its phase points: the
job's worker (``hotspare/testing/workers/job_worker.py``) does, on DeepSpeed and on megatron-core.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .. import faults as points

KINDS = ("kill", "segv", "exception", "hang", "node", "corrupt", "slow")
PHASES = ("forward", "backward", "step", "mirror", "keeper", "recovery")
PHASES_OF = {"kill": PHASES, "segv": PHASES, "exception": PHASES, "hang": PHASES, "node": PHASES,
             "corrupt": ("mirror", "keeper"), "slow": ("mirror",)}
"""The phases of each kind the fault matrix crosses. Besides them, ``slow@forward:RANK:STEP:FACTOR``
(a straggler, for the handover: not a failure, so not one of the matrix's cases yet)."""
SPARE = -1
"""``Fault.rank`` of a fault that strikes the process that started as a spare."""
SLOW_S = 3600.0
"""How long a ``slow`` transfer stalls (it is killed long before)."""
SLOW_KILL_S = 2.0
"""When a ``slow`` rank is killed after its transfer stalled: many steps' worth here, so the next
step found the round still in flight."""
SENDS_BEFORE = 3
"""Messages of the step's mirror transfer that leave before a ``mirror`` fault fires (a header
and two chunks)."""


class InjectedFault(RuntimeError):
    """The ``exception`` kind: a bug in one rank's training step (not a distributed failure)."""


@dataclass(frozen=True)
class Fault:
    """One fault: what, where in the step, on which rank, at which step (and micro-batch)."""

    kind: str
    phase: str
    rank: int
    step: int
    micro: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.phase not in PHASES_OF[self.kind] and not (self.kind == "slow" and self.phase == "forward"):
            raise ValueError(f"fault {self.kind!r} does not apply to phase {self.phase!r} (it applies to "
                             f"{', '.join(PHASES_OF[self.kind])})")
        if self.rank < SPARE or self.step < 0 or self.micro < 0:
            raise ValueError(f"fault {self}: rank, step and micro-batch must be >= 0 (rank may be 'spare')")
        if self.slowdown and self.micro < 2:
            raise ValueError(f"fault {self}: slow@forward:RANK:STEP:FACTOR needs FACTOR >= 2 (times slower)")

    @property
    def slowdown(self) -> bool:
        """A straggler from ``step`` on (``micro`` is its factor), not a one-off strike."""
        return self.kind == "slow" and self.phase == "forward"

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``KIND@PHASE:RANK:STEP[:MICRO]``; RANK is an int or ``spare``."""
        try:
            kind, rest = text.split("@")
            phase, rank, step, *micro = rest.split(":")
            if len(micro) > 1:
                raise ValueError
            return cls(kind, phase, SPARE if rank == "spare" else int(rank), int(step), int(micro[0]) if micro else 0)
        except ValueError as exc:
            if "fault" in str(exc):
                raise
            raise ValueError(f"fault {text!r}: expected KIND@PHASE:RANK:STEP[:MICRO], e.g. kill@forward:1:5 "
                             f"(KIND one of {', '.join(KINDS)}; PHASE one of {', '.join(PHASES)})") from None

    def __str__(self) -> str:
        rank = "spare" if self.rank == SPARE else str(self.rank)
        return f"{self.kind}@{self.phase}:{rank}:{self.step}" + (f":{self.micro}" if self.micro else "")


def fire(kind: str) -> None:
    """Strike this process with ``kind`` now (``corrupt`` and ``slow`` end in a SIGKILL here)."""
    if kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)  # faulthandler prints the stack, then the signal ends it
        time.sleep(5.0)
    elif kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)  # the launcher kills it when its heartbeats stop
        while True:  # if someone sends SIGCONT, it stays stuck (its peers find it by their timeouts)
            time.sleep(1.0)
    elif kind == "exception":
        raise InjectedFault("injected exception in the training step (a bug on this rank)")
    elif kind == "node":
        points.lose_node()
    os.kill(os.getpid(), signal.SIGKILL)


def _flip(buf: torch.Tensor | None) -> int:
    if buf is None or buf.numel() == 0:
        return 0
    flat = buf.view(torch.uint8).reshape(-1)
    flat[flat.numel() // 2] ^= 0xFF
    return 1


def arm_recovery_faults(faults: Iterable[Fault | str], worker: str, role: str, rank: int | None) -> None:
    """Arm the ``recovery``-phase faults of this process before ``initialize`` (a spare joins its
    first generation inside it): an active rank's fires as it joins generation 1 (the first
    recovery), the spare's as the first spare of the job to be called into a generation joins it."""
    for f in (f if isinstance(f, Fault) else Fault.parse(f) for f in faults):
        if f.phase != "recovery":
            continue
        if f.rank == SPARE and role == "spare":
            points.arm("join", at=points.ANY, action=lambda f=f: first_spare(f, None) and fire(f.kind))
        elif f.rank != SPARE and role == "active" and worker == f"a{f.rank}" and rank == f.rank:
            points.arm("join", at=1, action=lambda f=f: fire(f.kind))


def first_spare(f: Fault, store) -> bool:
    """Whether this process is the first spare to reach ``f`` (a spare-targeted fault strikes one
    spare, not each one that replaces the last); decided through the control store."""
    if store is None:
        from ..generation import store_from_env

        store = store_from_env()
    return store.add(f"fault/{f}", 1) == 1


class Injector:
    """Fires this process's faults at the worker's phase points.

    ``session`` is the hotspare session (its ``generation.rank``, ``spare``, ``mirror``);
    ``worker`` this process's worker id (``hotspare.worker.worker_id()``).
    """

    def __init__(self, faults: Iterable[Fault | str], session, worker: str):
        self.faults = [f if isinstance(f, Fault) else Fault.parse(f) for f in faults]
        self.session, self.worker = session, worker
        self.fired: list[str] = []
        self._corrupted: set[str] = set()

    def _targets(self, f: Fault) -> bool:
        if f.rank == SPARE:
            return self.session.spare
        return self.worker == f"a{f.rank}" and self.session.generation.rank == f.rank

    def _mine(self, phase: str, step: int, micro: int | None = None) -> Fault | None:
        for f in self.faults:
            # ``corrupt`` faults are after_step's alone (every rank takes part in them).
            if (f.phase == phase and f.step == step and (micro is None or f.micro == micro) and f.kind != "corrupt"
                    and str(f) not in self.fired and self._targets(f)):
                self.fired.append(str(f))
                if f.rank == SPARE and not first_spare(f, self.session.store):
                    continue
                return f
        return None

    # ---- the worker's phase points ------------------------------------------------------------

    def forward(self, step: int, micro: int = 0, module: torch.nn.Module | None = None) -> None:
        """Before the forward of ``micro`` (of ``module``, the whole model: what a ``slow@forward``
        fault slows)."""
        for f in self.faults:
            if f.slowdown and step >= f.step and f.rank != SPARE and self._targets(f) and module is not None:
                slow_down(module, f.micro)
        f = self._mine("forward", step, micro)
        if f is not None and not f.slowdown:
            fire(f.kind)

    def backward(self, step: int, micro: int, module: torch.nn.Module) -> None:
        """Before the forward of ``micro``: arm a fault that fires when the backward's gradient
        reaches ``module``'s output (the model's first block: mid-backward, some buckets reduced)."""
        f = self._mine("backward", step, micro)
        if f is None:
            return
        handles = []

        def arm(_module, _inputs, out):
            handles.pop().remove()
            out = out[0] if isinstance(out, tuple) else out
            out.register_hook(lambda _grad: fire(f.kind))

        handles.append(module.register_forward_hook(arm))

    def before_step(self, step: int) -> None:
        """After the backward, before the optimizer step (which captures the state for the mirror
        and the keeper): fires ``step`` faults, arms ``mirror`` and ``keeper`` ones."""
        f = self._mine("step", step)
        if f is not None:
            fire(f.kind)
        f = self._mine("keeper", step)
        if f is not None and f.kind != "corrupt":
            # Inside the keeper transaction: between chunk 0's and chunk 1's commit records.
            points.arm("keeper_commit", at=1, action=lambda f=f: fire(f.kind))
        f = self._mine("mirror", step)
        if f is not None and f.kind != "corrupt":
            self._arm_transfer(f.kind)

    def after_step(self, step: int) -> None:
        """After the optimizer step and its mirror round started: the ``corrupt`` kind (every rank
        takes part: holders flip their copies of the target)."""
        for f in list(self.faults):
            if f.kind != "corrupt" or f.step != step or str(f) in self._corrupted:
                continue
            self._corrupted.add(str(f))  # once, on every rank: a replayed step does not corrupt again
            if self.session.spare and f.rank != SPARE:
                continue  # a spare that replays the step was not there when it struck
            mirror = self.session.mirror
            if mirror is None:
                continue
            if self.session.spare:
                # Alone here (the others passed this step before it took over): no agreement
                # collective they would not join ('skip' mode), just its own round to end.
                mirror.settle(mirror.timeout_s)
            else:
                mirror.flush()  # the step's round is complete everywhere: its copies are committed
            target = self.session.generation.rank if f.rank == SPARE else f.rank
            if f.phase == "mirror" and target in mirror.copies:
                copy = mirror.copies[target]
                _flip(copy.committed)
                _flip(copy.incoming)  # the version before, kept until the next round
            # A spare-targeted fault strikes the first spare that reaches it, not each spare that
            # replaces the one it killed and replays the step.
            if self._targets(f) and (f.rank != SPARE or first_spare(f, self.session.store)):
                self.fired.append(str(f))
                if f.phase == "keeper" and mirror.snapshots is not None and hasattr(mirror.snapshots, "segment"):
                    for slot in mirror.snapshots.segment.slots:
                        _flip(slot)
                if f.phase == "mirror":
                    # Holders flip in their own after_step; wait until every one has (the next
                    # step's first collective orders it) by dying only then: at the next forward.
                    self.faults.append(Fault("kill", "forward", f.rank, step + 1))
                else:
                    fire("kill")

    def _arm_transfer(self, kind: str) -> None:
        mirror = self.session.mirror
        if mirror is None:
            raise RuntimeError("a mirror-phase fault needs mirroring on (hotspare.mirror)")
        transport = mirror.transport
        send, sent = transport.send, [0]

        def send_then_fail(tensor, dst, tag):
            sent[0] += 1
            if sent[0] == SENDS_BEFORE + 1:
                if kind == "slow":
                    # Stalled past the in-flight window: the next step waits for this round
                    # (mirror.in_flight 'wait') or skips a version ('skip'); then the rank dies.
                    threading_kill_after(SLOW_KILL_S)
                    time.sleep(SLOW_S)
                fire(kind)
            return send(tensor, dst, tag)

        transport.send = send_then_fail


def slow_down(module: torch.nn.Module, factor: int) -> None:
    """Make ``module``'s next forward compute ``factor`` times as long, the way a slower device
    would: every module under it (itself included) sleeps ``factor - 1`` times what it computed
    itself (its forward's time less its children's), before any other forward hook sees it end,
    so that a compute clock on the whole model or on its leaves counts it. On ZeRO 3 a module's
    time is counted from the end of DeepSpeed's pre-hook (its parameter gather), registered
    before these."""
    handles, stack = [], []

    def begin(_module, _args):
        stack.append([time.perf_counter(), 0.0])  # its start, and its children's time so far

    def end(_module, _args, _out):
        start, children = stack.pop()
        time.sleep((factor - 1) * max(0.0, time.perf_counter() - start - children))
        if stack:
            stack[-1][1] += time.perf_counter() - start

    def done(_module, _args, _out):
        for h in handles:
            h.remove()

    for m in module.modules():
        handles.append(m.register_forward_pre_hook(begin))
        handles.append(m.register_forward_hook(end, prepend=True))
    handles.append(module.register_forward_hook(done))


def threading_kill_after(seconds: float) -> None:
    """SIGKILL this process after ``seconds`` from a daemon thread (whatever the others do)."""
    import threading

    def later():
        time.sleep(seconds)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=later, name="hotspare-fault-timer", daemon=True).start()
