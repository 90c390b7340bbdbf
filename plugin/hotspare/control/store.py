"""``ControlStore``: the few operations the launchers, the coordinator and the workers perform on
the control store. Nobody else spells a key (:mod:`.keys`) or parses a value (:mod:`.messages`).

Every value the job acts on is signed with the job's secret (:mod:`.auth`); one whose
signature does not hold reads as absent, and is named once. The lists (failures, spares,
survivors' reports, kill requests) live under names only the job can compute, and are read with a
cursor that goes past holes (:mod:`.lists`). A single value that does not parse raises
:class:`~.messages.BadMessage` naming its key. Wake keys are not signed: waking a waiter only
makes it look again at signed values. Values rewritten over time carry a sequence that only goes
up (heartbeats): a replayed older one is not new.
"""
from __future__ import annotations

import datetime
import math
import sys
import time
from collections.abc import Sequence

from . import keys, lists
from .auth import Signer
from .lists import HOLE_S, ListCursor
from .messages import BadMessage, Failure, Kill, Plan, Prepare, Spare, Waiting, parse, to_json
from .moves import Moves

__all__ = ["WAKE_WAIT", "FORGED_POLL_S", "HOLE_S", "ControlStore", "ListCursor"]

WAKE_WAIT = datetime.timedelta(days=7)
"""A blocking wait that has no end of its own (a spare's on ``wake/<wid>``, a worker's on its
alarm): without limit in practice, and short of poll()'s 2**31 ms."""
FORGED_POLL_S = 0.05
"""How often a wait looks again at a key that holds a value not signed by this job."""


def _log(message: str) -> None:
    print(f"[hotspare control] {message}", file=sys.stderr, flush=True)


class ControlStore(Moves):
    """The control plane's view of a ``torch.distributed.Store`` (``raw``)."""

    def __init__(self, raw, signer: Signer | None = None, clock=time.monotonic):
        self.raw = raw
        self.signer = signer if signer is not None else Signer.from_env()
        self.clock = clock
        """Seconds, monotonic: how long a list's holes have waited (tests drive one)."""
        self._named: set[tuple[str, str]] = set()  # (key, problem) said once
        self._beat_base: dict[str, int] = {}  # worker id -> the sequence its beat count 0 stands for
        self._beat_last: dict[str, int] = {}  # worker id -> the last sequence this process beat

    def say(self, message: str) -> None:
        _log(message)

    def say_once(self, key: str, problem: str) -> None:
        if (key, problem) not in self._named:
            self._named.add((key, problem))
            _log(f"control store key {key!r}: {problem}")

    # ---- values -----------------------------------------------------------------------------
    def put(self, key: str, value: str) -> None:
        """Set ``key`` to ``value``, signed. The typed operations below are how the job writes;
        this and :meth:`text`, :meth:`append` are for them and for tests of what a bad value does."""
        self.raw.set(key, self.signer.sign(key, value))

    def _open(self, key: str, stored: bytes) -> str | None:
        value = self.signer.open(key, stored)
        if value is None:
            self.say_once(key, "not signed with this job's secret (another job's, or a stranger's); ignored")
        return value

    def text(self, key: str) -> str | None:
        """The value of ``key``, or None if unset or not signed by this job."""
        if not self.raw.check([key]):
            return None
        return self._open(key, self.raw.get(key))

    def _has(self, key: str) -> bool:
        return self.text(key) is not None

    def _int(self, key: str) -> int | None:
        text = self.text(key)
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            raise BadMessage(key, f"{text[:80]!r} is not an integer") from None

    def _float(self, key: str) -> float | None:
        text = self.text(key)
        if text is None:
            return None
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and value > 0):
            raise BadMessage(key, f"{text[:80]!r} is not a finite number > 0")
        return value

    def wait(self, key: str, timeout_s: float, what: str) -> str:
        """``key``'s value once it is set and signed by this job: blocks in the store (woken the
        moment it is written, the GIL released; no poll delay, one request per waiter). Past a
        value not signed by this job (left in place: removing it could remove the real one
        written meanwhile) the wait polls. Raises TimeoutError naming ``what``. torch cancels a
        wait that timed out on the server, so the connection stays usable."""
        deadline = time.monotonic() + timeout_s
        try:
            self.raw.wait([key], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # torch.distributed.DistStoreError
            if "timeout" not in str(exc).lower():
                raise
            raise TimeoutError(f"waited {timeout_s:g} s for {what} (store key {key!r})") from None
        while True:
            value = self.text(key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:g} s for {what} (store key {key!r} holds a value not "
                                   f"signed by this job)")
            time.sleep(FORGED_POLL_S)

    # ---- lists ------------------------------------------------------------------------------
    def append(self, prefix: str, value: str) -> int:
        """Add ``value`` (signed) as the next entry of the list ``prefix`` (``keys.FAIL``, ...)."""
        return lists.append(self, prefix, value)

    def read(self, cursor: ListCursor) -> list[tuple[int, object]]:
        """The entries of ``cursor``'s list it has not read yet, signed by this job and parsed,
        with their indices; holes are gone past (:mod:`.lists`)."""
        return lists.read(self, cursor, self.clock())

    def _entries(self, prefix: str, start: int | ListCursor) -> tuple[list, int]:
        """The new entries of list ``prefix`` and the index every entry below is done with. A
        reader that looks again keeps a :class:`ListCursor`; an int reads once from that index."""
        cursor = start if isinstance(start, ListCursor) else ListCursor(prefix, scanned=start)
        assert cursor.prefix == prefix, (cursor.prefix, prefix)
        return [entry for _, entry in self.read(cursor)], cursor.next

    def report_failure(self, failure: Failure) -> int:
        return self.append(keys.FAIL, to_json(failure))

    def failures(self, start: int | ListCursor) -> tuple[list[Failure], int]:
        return self._entries(keys.FAIL, start)

    def failure_count(self) -> int:
        """How many failure entries the job counted (its own counter, which only its processes
        can move). For tests and logs: a decision reads the entries (:meth:`read`), each signed."""
        return lists.own_count(self, keys.FAIL)

    def register_spare(self, wid: str, node: int) -> int:
        return self.append(keys.SPARE, to_json(Spare(wid, node)))

    def spares(self, start: int | ListCursor) -> tuple[list[Spare], int]:
        return self._entries(keys.SPARE, start)

    def report_waiting(self, report: Waiting) -> int:
        return self.append(keys.WAIT, to_json(report))

    def waiting(self, start: int | ListCursor) -> tuple[list[Waiting], int]:
        return self._entries(keys.WAIT, start)

    def ask_kill(self, wid: str, detect_s: float) -> int:
        return self.append(keys.KILL, to_json(Kill(wid, detect_s)))

    def kills(self, start: int | ListCursor) -> tuple[list[Kill], int]:
        return self._entries(keys.KILL, start)

    # ---- plans ------------------------------------------------------------------------------
    def has_plan(self, generation: int) -> bool:
        return self._has(keys.plan(generation))

    def plan(self, generation: int) -> Plan:
        key = keys.plan(generation)
        text = self.text(key)
        if text is None:
            raise BadMessage(key, "no plan signed by this job")
        plan = Plan.from_json(text, key)
        if plan.generation != generation:
            raise BadMessage(key, f"holds the plan of generation {plan.generation}")
        return plan

    def write_plan(self, plan: Plan) -> None:
        self.put(keys.plan(plan.generation), plan.to_json())

    def superseded(self, generation: int) -> bool:
        """Whether generation ``generation`` has a successor (a plan for the next one)."""
        return self.has_plan(generation + 1)

    def newest_generation(self, since: int = 0) -> int:
        g = since
        while self.has_plan(g + 1):
            g += 1
        return g

    def current_plan(self, world_size: int) -> Plan:
        """The newest plan (generation 0's, the initial workers, before any failure)."""
        g = self.newest_generation()
        if g == 0:
            return Plan(0, world_size, {str(r): keys.active_id(r) for r in range(world_size)})
        return self.plan(g)

    # ---- spares -----------------------------------------------------------------------------
    def set_ready(self, wid: str, scope: str) -> None:
        self.put(keys.ready(wid), scope)

    def ready_scope(self, wid: str) -> str | None:
        """What spare ``wid`` said it can take (SPARE_ANY, SPARE_LOCAL), or None if not ready."""
        text = self.text(keys.ready(wid))
        if text is not None and text not in (keys.SPARE_ANY, keys.SPARE_LOCAL):
            raise BadMessage(keys.ready(wid), f"{text[:80]!r} is neither {keys.SPARE_ANY!r} nor {keys.SPARE_LOCAL!r}")
        return text

    def is_ready(self, wid: str) -> bool:
        return self._has(keys.ready(wid))

    def send_prepare(self, wid: str, prepare: Prepare) -> None:
        self.put(keys.prepare(wid), to_json(prepare))

    def prepare_for(self, wid: str) -> Prepare | None:
        text = self.text(keys.prepare(wid))
        return None if text is None else parse(Prepare, text, keys.prepare(wid))

    def send_orders(self, plan: Plan) -> None:
        """Write ``plan`` and each of its promoted spares' order, then wake them."""
        self.write_plan(plan)
        for wid in plan.replaced.values():
            self.put(keys.order(wid), str(plan.generation))
            self.wake(wid)

    def order_for(self, wid: str) -> int | None:
        return self._int(keys.order(wid))

    def wake(self, wid: str) -> None:
        """Wake spare ``wid`` from its wait (after writing what it must read). Not signed: a
        waiter woken by anyone only looks again at the signed values."""
        self.raw.set(keys.wake(wid), "1")

    def wait_for_wake(self, wid: str) -> None:
        """Block until ``wake/<wid>`` is set, then clear it (the next wake is a new one)."""
        self.raw.wait([keys.wake(wid)], WAKE_WAIT)

    def clear_wake(self, wid: str) -> None:
        self.raw.delete_key(keys.wake(wid))

    def set_unfit(self, wid: str, message: str) -> None:
        self.put(keys.unfit(wid), message)

    def unfit(self, wid: str) -> str | None:
        text = self.text(keys.unfit(wid))
        return None if text is None else text[:2000]

    # ---- heartbeats -------------------------------------------------------------------------
    # A worker's beats carry a sequence that only goes up, even across the Heartbeats one process
    # makes: the launcher counts a beat only past the last one it counted, so a replayed older
    # (signed) beat is not news. A goodbye is the negative of its sequence.
    def beat(self, wid: str, count: int) -> None:
        """Beat ``count`` (1, 2, ... after :meth:`start_beating`'s 0) of this process's beats."""
        sequence = self._beat_base.get(wid, 0) + count
        self._beat_last[wid] = sequence
        self.put(keys.heartbeat(wid), str(sequence))

    def start_beating(self, wid: str, timeout_s: float) -> None:
        self.put(keys.heartbeat_timeout(wid), str(timeout_s))
        try:
            last = self.beats(wid)
        except BadMessage:
            last = None
        self._beat_base[wid] = 0 if last is None else abs(last) + 1
        self.beat(wid, 0)

    def say_goodbye(self, wid: str) -> None:
        """Heartbeats end here on purpose (the launcher stops watching them)."""
        self.put(keys.heartbeat(wid), str(-(self._beat_last.get(wid, 0) + 1)))

    def beats(self, wid: str) -> int | None:
        return self._int(keys.heartbeat(wid))

    def beat_timeout(self, wid: str) -> float | None:
        """The silence worker ``wid`` allows (finite, > 0; BadMessage naming the key otherwise)."""
        return self._float(keys.heartbeat_timeout(wid))

    def beat_node(self, node: int, count: int) -> None:
        """Node ``node``'s launcher beats (a set: the store's reply proves it arrived)."""
        self.put(keys.node_heartbeat(node), str(count))

    def node_beats(self, node: int) -> int:
        """Node ``node``'s launcher's last signed beat (0: none yet); a reader counts only one past
        the last it counted (a replayed older beat is not news)."""
        return self._int(keys.node_heartbeat(node)) or 0

    # ---- the job's flags --------------------------------------------------------------------
    def alarm(self, generation: int, wids: Sequence[str]) -> None:
        """Tell every worker in ``wids`` that generation ``generation`` failed (one request)."""
        names = [keys.alarm(generation, wid) for wid in wids]
        if names:
            self.raw.multi_set(names, [self.signer.sign(name, "1") for name in names])

    def wait_for_alarm(self, generation: int, wid: str) -> str:
        """Block until the coordinator says generation ``generation`` failed ("1"), or the worker
        ended its own wait, closing ("closed"). Past an alarm not signed by this job the wait
        polls (every FORGED_POLL_S) for the real one."""
        key = keys.alarm(generation, wid)
        self.raw.wait([key], WAKE_WAIT)
        while True:
            value = self.text(key)
            if value is not None:
                return value
            time.sleep(FORGED_POLL_S)  # a forgery sits on the key: look until the real one replaces it

    def end_alarm_wait(self, generation: int, wid: str) -> None:
        """A closing worker ends its own alarm thread's wait."""
        self.put(keys.alarm(generation, wid), "closed")

    def set_exited(self, wid: str, code: int) -> None:
        self.put(keys.exited(wid), str(code))

    def abort(self, message: str) -> None:
        self.put(keys.ABORT, message)

    def abort_message(self) -> str | None:
        return self.text(keys.ABORT)

    def shut_down(self) -> None:
        self.put(keys.SHUTDOWN, "1")

    def is_shut_down(self) -> bool:
        return self._has(keys.SHUTDOWN)

    def set_finished(self, rank: int, wid: str) -> None:
        self.put(keys.finished(rank), wid)

    def finished(self, rank: int) -> bool:
        return self._has(keys.finished(rank))

    def mark_trained(self) -> None:
        self.put(keys.TRAINED, "1")

    def trained(self) -> bool:
        return self._has(keys.TRAINED)

    def set_caught_up(self, generation: int, step: int) -> None:
        self.put(keys.caught_up(generation), str(step))

    def caught_up(self, generation: int) -> bool:
        return self._has(keys.caught_up(generation))

    def publish_job(self, job_id: str) -> None:
        """Node 0's launcher: the job's id (signed without a job id: it is what names the job)."""
        self.raw.set(keys.JOB_ID, self.signer.sign(keys.JOB_ID, job_id, job_id=""))

    def job_id(self) -> str | None:
        """The job's id; None when the store has none. JoinRefused-worthy (ValueError) when it
        is not signed with this process's secret: another job's store, or another secret."""
        if not self.raw.check([keys.JOB_ID]):
            return None
        value = self.signer.open(keys.JOB_ID, self.raw.get(keys.JOB_ID), job_id="")
        if value is None:
            raise BadMessage(keys.JOB_ID, "not signed with this process's job secret: this store serves another "
                                          "job, or the job was started with another --job-secret-file")
        return value

    def guard_identity(self, job_id: str, known: str | None) -> str | None:
        """Node 0's launcher: put back the job's id and fingerprint where someone else wrote over
        or removed them (every process that joins later would be refused, naming the key); the
        fingerprint known so far."""
        try:
            lost = self.job_id() is None
        except BadMessage:
            lost = True
        if lost:
            self.say_once(keys.JOB_ID, "written over or removed by someone else; put back")
            self.publish_job(job_id)
        stored = self.raw.get(keys.FINGERPRINT) if self.raw.check([keys.FINGERPRINT]) else None
        theirs = None if stored is None else self.signer.open(keys.FINGERPRINT, stored)
        if theirs is None and known is not None:
            self.say_once(keys.FINGERPRINT, "written over or removed by someone else; put back")
            self.raw.set(keys.FINGERPRINT, self.signer.sign(keys.FINGERPRINT, known))
        return theirs or known

    def claim_fingerprint(self, mine: str) -> str:
        """The job's fingerprint: ``mine`` if this is the first claim, else the first one's."""
        stored = self.raw.compare_set(keys.FINGERPRINT, "", self.signer.sign(keys.FINGERPRINT, mine))
        theirs = self.signer.open(keys.FINGERPRINT, stored)
        if theirs is None:
            raise BadMessage(keys.FINGERPRINT, "not signed with this job's secret")
        return theirs

    def arrived(self, generation: int, world_size: int) -> bool:
        """Whether every member of generation ``generation`` arrived in its rendezvous."""
        return self.raw.check([keys.arrived(generation, r) for r in range(world_size)])


