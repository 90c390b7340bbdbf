"""The job's lists in the control store (failures, spares, survivors' reports, kill requests):
how an entry is added, and how a reader goes through them.

A list's entries live under a name only the job's processes can compute: ``<prefix><tag>/<i>``,
counted by ``<prefix><tag>/count``, ``tag`` an HMAC of the list's name with the job's secret
(:meth:`~.auth.Signer.private_name`). So a process without the secret can neither find, move nor
corrupt the job's counter or its entries. (The counter must be safe from strangers: a TCPStore
``add`` on a key holding anything but an integer makes the store drop the caller's connection for
good, so one ``set fail/count x`` used to cut node 0's launcher off its own store.) The public
names, ``<prefix><i>`` counted by ``<prefix>count``, are where a stranger writes: a reader looks
at the newest of them only to name what it finds there (never acted on); it reads that counter
with a plain get, never an ``add``.

A reader keeps a :class:`ListCursor`. An index counted but not written (yet: a writer counts,
then writes, microseconds apart; or it died between the two) is a hole: the entries after it are
read at once, and the hole is looked at again on later reads. All the holes found in one read
share one wait of :data:`HOLE_S`; then they are skipped, with one line naming the list and their
number.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import keys
from .messages import BadMessage, Drain, Failure, Handover, Kill, Spare, Waiting, parse

HOLE_S = 2.0
"""A list index counted but not written (or not signed by the job) for this long is a hole:
skipped. A writer sets its entry microseconds after it counts it."""
SCAN_MAX = 1024
"""At most this many indices looked at per read past those already looked at, and this many
holes looked at again (a counter moved far ahead is gone through over several reads)."""
PUBLIC_PEEK = 64
"""A stranger's entries looked at per read: the newest of the public counter's, to name them."""

MESSAGES = {keys.FAIL: Failure, keys.SPARE: Spare, keys.WAIT: Waiting, keys.KILL: Kill, keys.HANDOVER: Handover,
            keys.DRAIN: Drain}
"""The message each list holds."""


@dataclass
class ListCursor:
    """One reader's place in one list (``prefix``: ``keys.FAIL``, ``keys.SPARE``, ...)."""

    prefix: str
    scanned: int = 0
    """Every index below it was looked at: read, refused, or waited for in ``holes``."""
    holes: dict[int, float] = field(default_factory=dict)
    """Index -> when it was first found counted but not written (or not signed by the job)."""
    public_scanned: int = 0
    public_holes: dict[int, float] = field(default_factory=dict)

    @property
    def next(self) -> int:
        """Every index below it is done with (read or skipped)."""
        return min(self.holes, default=self.scanned)


def private_prefix(signer, prefix: str) -> str:
    return f"{prefix}{signer.private_name(prefix)}/"


def append(store, prefix: str, value: str) -> int:
    """Add ``value`` (signed) as the next entry of list ``prefix``; its index."""
    private = private_prefix(store.signer, prefix)
    index = store.raw.add(f"{private}count", 1) - 1
    store.put(f"{private}{index}", value)
    return index


def own_count(store, prefix: str) -> int:
    """How many entries the job counted in list ``prefix``: one request (an ``add`` of 0 on the
    private counter, which no stranger can find to corrupt)."""
    return int(store.raw.add(f"{private_prefix(store.signer, prefix)}count", 0))


def count(store, key: str) -> int | None:
    """The integer ``key`` holds, read with a plain get (an ``add`` on a word would drop the
    connection); None when unset; said once and None when it holds something else."""
    if not store.raw.check([key]):
        return None
    text = store.raw.get(key).decode("utf-8", errors="replace")
    if not (text.isdigit() and len(text) <= 18):
        store.say_once(key, f"holds {text[:40]!r}, not a count; ignored")
        return None
    return int(text)


def read(store, cursor: ListCursor, now: float) -> list[tuple[int, object]]:
    """The new entries of ``cursor``'s list, signed by the job and parsed, with their indices."""
    private = private_prefix(store.signer, cursor.prefix)
    n = own_count(store, cursor.prefix)
    top = min(n, cursor.scanned + SCAN_MAX)
    looks = sorted(cursor.holes)[:SCAN_MAX] + list(range(cursor.scanned, top))
    cursor.scanned = max(cursor.scanned, top)
    shown = f"{cursor.prefix}<job>/"  # the tag is not logged: a log reader could then move the counter
    out = []
    for i in looks:
        key = f"{private}{i}"
        value = store.signer.open(key, store.raw.get(key)) if store.raw.check([key]) else None
        if value is None:  # not written yet, or not signed (a sniffer's): the job's write may follow
            cursor.holes.setdefault(i, now)
            continue
        cursor.holes.pop(i, None)
        try:
            out.append((i, parse(MESSAGES[cursor.prefix], value, f"{shown}{i}")))
        except BadMessage as exc:
            store.say_once(f"{shown}{i}", f"{str(exc).split(': ', 1)[-1]}; skipped")
    _skip_holes(store, cursor.holes, now, f"{shown}count", shown)
    _look_at_public(store, cursor, now)
    return sorted(out, key=lambda e: e[0])


def _skip_holes(store, holes: dict[int, float], now: float, counter: str, prefix: str) -> None:
    """Skip the holes waited for HOLE_S (those found in one read together); one line for them."""
    done = sorted(i for i, since in holes.items() if now - since >= HOLE_S)
    for i in done:
        del holes[i]
    if len(done) == 1:
        store.say_once(f"{prefix}{done[0]}", f"counted in {counter!r} but not written for {HOLE_S:g} s; skipped")
    elif done:
        store.say(f"control store list {prefix!r}: {len(done)} entries counted in {counter!r} but not written for "
                  f"{HOLE_S:g} s ({prefix}{done[0]} .. {prefix}{done[-1]}); skipped")


def _look_at_public(store, cursor: ListCursor, now: float) -> None:
    """Name what a stranger wrote under the list's public names (the newest PUBLIC_PEEK of them)."""
    counter = f"{cursor.prefix}count"
    n = count(store, counter)
    if n is None:
        return
    floor = n - PUBLIC_PEEK
    if cursor.public_scanned < floor:
        store.say_once(counter, f"moved far ahead by someone other than this job (its lists are kept under names "
                                f"only its processes know); only its newest {PUBLIC_PEEK} entries are looked at")
    start = max(cursor.public_scanned, floor)
    cursor.public_holes = {i: t for i, t in cursor.public_holes.items() if i >= floor}
    looks = sorted(cursor.public_holes) + list(range(start, n))
    cursor.public_scanned = max(cursor.public_scanned, n)
    unsigned = []
    for i in looks:
        key = f"{cursor.prefix}{i}"
        if not store.raw.check([key]):
            cursor.public_holes.setdefault(i, now)
            continue
        cursor.public_holes.pop(i, None)
        if store.signer.open(key, store.raw.get(key)) is None:
            unsigned.append(key)
    if len(unsigned) > 2:
        store.say(f"control store keys {unsigned[0]!r} .. {unsigned[-1]!r} ({len(unsigned)} values): not signed "
                  f"with this job's secret (another job's, or a stranger's); ignored")
    else:
        for key in unsigned:
            store.say_once(key, "not signed with this job's secret (another job's, or a stranger's); ignored")
    _skip_holes(store, cursor.public_holes, now, counter, cursor.prefix)
