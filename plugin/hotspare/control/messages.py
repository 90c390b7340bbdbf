"""The typed messages of the control store, and their strict parsing.

Each message is a dataclass written as a JSON object. :func:`parse` accepts exactly the
dataclass's fields with their types (an int where an int is due, a finite number where a float
is, worker ids where ids are) and raises :class:`BadMessage` naming the key and the field
otherwise: a value a stranger or a bug wrote never reaches a decision half-read.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import asdict, dataclass, field

from ..errors import HotspareError
from .keys import is_worker_id


class BadMessage(HotspareError, ValueError):
    """A control-store value that is not the message its key holds."""

    def __init__(self, key: str, why: str):
        super().__init__(f"control store key {key!r}: {why}")
        self.key = key


@dataclass
class Failure:
    """One failure a launcher saw."""

    worker: str
    """Worker id (``a<rank>`` or ``s<node>.<k>``)."""
    rank: int
    """The active rank it held, or -1 for a spare."""
    code: int
    """Exit code (negative: killed by that signal)."""
    reason: str
    """'exit' (the process ended), 'heartbeat' (it stopped beating and was killed), 'watchdog'
    (its peers' collectives timed out waiting for it while it kept beating; killed), 'node' (its
    node's launcher stopped beating: the node is down or cut off, and fences itself) or 'handover'
    (it was asked to hand its rank to a spare, and left at a step boundary: not a failure)."""
    wall_time: float
    """time.time() when the launcher saw it (fault-to-detection is measured from here backwards)."""
    detect_s: float = 0.0
    """Seconds from the fault to this report, as far as the launcher can tell: 'heartbeat' the
    silence; 'watchdog' the peers' collective timeout plus the wait for the stragglers' reports;
    'exit' 0 (the exit is seen within one poll, ``launch.POLL_INTERVAL_S``)."""


@dataclass
class Prepare:
    """The coordinator's early word to a spare (``prepare/<wid>``): the rank it will take; the
    plan of ``generation`` follows and keeps that assignment."""

    rank: int
    world_size: int
    generation: int
    replaces: str = ""
    """The failed worker whose rank this is (a spare taking its device waits for ``exited/<it>``)."""


@dataclass
class Waiting:
    """A survivor's report that it saw a failure and left its generation."""

    worker: str
    rank: int
    generation: int
    """The generation it left."""
    timed_out: bool = False
    """Its failure was a collective that timed out (no peer error): someone may be stuck."""
    waited_s: float = 0.0
    """How long that collective waited (its group's timeout) when ``timed_out``."""
    rendezvous_timeout_s: float = 0.0
    """How long it waits for the next generation's members (``recovery.rendezvous_timeout_s``;
    0: not said): the coordinator kills a member stuck in the failed generation before that."""


@dataclass
class Spare:
    """A spare its launcher registered (``spare/<i>``)."""

    worker: str
    node: int


@dataclass
class Kill:
    """The coordinator's request that a worker's launcher kill it as hung (``kill/<i>``)."""

    worker: str
    detect_s: float = 0.0


@dataclass
class Handover:
    """The coordinator's request that a worker's launcher have it hand its rank to a spare at its
    next step boundary (``handover/<i>``)."""

    worker: str
    rank: int
    cause: str
    """'straggler' (slower than its peers for the configured window) or 'drain' (an operator's)."""
    detail: str = ""
    generation: int = 0
    """The generation the order stands in: a recovery before the worker left voids it (the worker
    checks at its step boundary; the coordinator asks again in the new generation)."""


@dataclass
class Drain:
    """An operator's request (``hotspare-run drain``, signed with the job's secret) that every rank
    on ``node`` move to spares on other nodes, or that rank ``rank`` move to a spare
    (``drain/<i>``); the other field is -1."""

    node: int = -1
    rank: int = -1


@dataclass
class Sample:
    """One step's compute time of a worker."""

    step: int
    seconds: float


@dataclass
class Compute:
    """A worker's latest compute times (``compute/<wid>``), newest last."""

    stage: int
    """Its peer class: ranks are compared within one (a pipeline stage; 0 without pipelines)."""
    samples: list[dict] = field(default_factory=list)


@dataclass
class StragglerPolicy:
    """The straggler test's parameters (``stragglers``; the config's ``stragglers`` section)."""

    factor: float
    window: int


@dataclass
class Plan:
    """The coordinator's decision for one generation."""

    generation: int
    world_size: int
    workers: dict[str, str]
    """Active rank (as a string, JSON keys) -> worker id, for every rank."""
    replaced: dict[str, str] = field(default_factory=dict)
    """Rank -> worker id of the spare that takes it in this generation."""
    failures: list[dict] = field(default_factory=list)
    """The failures this plan answers (asdict of :class:`Failure`; each parsed as one)."""
    abort: str = ""
    """Non-empty: the job cannot go on; every worker stops with this message."""
    failures_read: int = 0
    """Every ``fail/`` entry below this index had been read when the coordinator planned: one at
    or past it, signed, for a worker this plan's failures do not name, is a failure the plan does
    not answer (the launchers then start their pending successor spares at once)."""

    def to_json(self) -> str:
        return to_json(self)

    @classmethod
    def from_json(cls, text: str | bytes, key: str = "plan") -> "Plan":
        return parse(cls, text, key)

    def rank_of(self, worker: str) -> int | None:
        for rank, wid in self.workers.items():
            if wid == worker:
                return int(rank)
        return None


def to_json(message) -> str:
    return json.dumps(asdict(message), sort_keys=True)


_WORKER_FIELDS = {"worker", "replaces"}
_CHOICES = {"reason": ("exit", "heartbeat", "watchdog", "node", "handover"), "cause": ("straggler", "drain")}


def _check(key: str, name: str, value, hint) -> None:
    def bad(what: str):
        raise BadMessage(key, f"field {name!r} is {value!r}"[:200] + f", not {what}")

    origin = typing.get_origin(hint)
    if hint is bool:
        if not isinstance(value, bool):
            bad("true or false")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            bad("an integer")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            bad("a finite number")
    elif hint is str:
        if not isinstance(value, str):
            bad("a string")
        short = name.rsplit(".", 1)[-1]
        if short in _WORKER_FIELDS and value and not is_worker_id(value):
            bad("a worker id (a<rank> or s<node>.<k>)")
        if short in _CHOICES and value not in _CHOICES[short]:
            bad(f"one of {', '.join(map(repr, _CHOICES[short]))}")
    elif origin is dict:
        if not isinstance(value, dict):
            bad("an object")
        for k, v in value.items():
            if not (k.isdigit() and isinstance(v, str) and is_worker_id(v)):
                raise BadMessage(key, f"field {name!r} maps {k!r} to {v!r}, not a rank to a worker id")
    elif origin is list:
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            bad("a list of objects")
    else:  # pragma: no cover - a field type this module does not know
        raise TypeError(f"{name}: no check for {hint}")


_ENTRIES = {(Plan, "failures"): Failure, (Compute, "samples"): Sample}
"""List fields whose every entry is a message of its own (parsed as one, kept as its dict)."""


def _from_data(cls, data, key: str, where: str = ""):
    """``data`` (a JSON value from ``key``) checked as a ``cls``: exactly its fields, each of its
    type. ``where``: the field that holds it, in a message of its own."""
    if not isinstance(data, dict):
        raise BadMessage(key, f"{where or 'value'} is not a JSON object: {str(data)[:80]!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    of = f" in {where}" if where else ""
    if unknown:
        raise BadMessage(key, f"unknown field(s) {unknown} for a {cls.__name__}{of}")
    missing = sorted(n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise BadMessage(key, f"missing field(s) {missing} of a {cls.__name__}{of}")
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        _check(key, f"{where}.{name}" if where else name, value, hints[name])
        entry = _ENTRIES.get((cls, name))
        if entry is not None:
            for i, item in enumerate(value):
                _from_data(entry, item, key, f"{name}[{i}]")
    return cls(**data)


def parse(cls, text: str | bytes, key: str):
    """``text`` (from ``key``) as a ``cls``: exactly its fields, each of its type; BadMessage
    naming the key and what is wrong otherwise."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadMessage(key, f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadMessage(key, f"not a JSON object: {str(text)[:80]!r}")
    return _from_data(cls, data, key)
