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
    (its peers' collectives timed out waiting for it while it kept beating; killed) or 'node' (its
    node's launcher stopped beating: the node is down or cut off, and fences itself)."""
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
class Plan:
    """The coordinator's decision for one generation."""

    generation: int
    world_size: int
    workers: dict[str, str]
    """Active rank (as a string, JSON keys) -> worker id, for every rank."""
    replaced: dict[str, str] = field(default_factory=dict)
    """Rank -> worker id of the spare that takes it in this generation."""
    failures: list[dict] = field(default_factory=list)
    """The failures this plan answers (asdict of :class:`Failure`)."""
    abort: str = ""
    """Non-empty: the job cannot go on; every worker stops with this message."""
    failures_read: int = 0
    """How many ``fail/<i>`` entries the coordinator had read when it planned: an entry beyond
    them is a failure this plan does not answer (the launchers then start their pending
    successor spares at once)."""

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


def _check(key: str, name: str, value, hint) -> None:
    def bad(what: str):
        raise BadMessage(key, f"field {name!r} is {value!r}, not {what}")

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
        if name in _WORKER_FIELDS and value and not is_worker_id(value):
            bad("a worker id (a<rank> or s<node>.<k>)")
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


def parse(cls, text: str | bytes, key: str):
    """``text`` (from ``key``) as a ``cls``: exactly its fields, each of its type; BadMessage
    naming the key and what is wrong otherwise."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadMessage(key, f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadMessage(key, f"not a JSON object: {str(text)[:80]!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise BadMessage(key, f"unknown field(s) {unknown} for a {cls.__name__}")
    missing = sorted(n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise BadMessage(key, f"missing field(s) {missing} of a {cls.__name__}")
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        _check(key, name, value, hints[name])
    return cls(**data)
