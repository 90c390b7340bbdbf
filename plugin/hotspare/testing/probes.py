"""What a stranger writes into a running job's control store, per key family: the fault matrix's
control-plane probes (``recipes/fault_matrix.py control=true``; docs/control-plane.md).

A stranger is a plain TCPStore client on the job's port without the job's secret. It can read
every public value (they are signed, not secret) and write anything under any name, but it cannot
sign. Four ways to write:

- ``unsigned``: the value the job itself would write there, with no signature;
- ``malformed``: a value that looks signed (``hs1.``, 64 hex digits, ``.``) over text that is not
  what the key holds, in every key family (:data:`FAMILIES`);
- ``forged``: a well-formed message of each kind, signed with the stranger's own secret under the
  job's id (read from ``job/id``): only the MAC is wrong;
- ``replay``: values the job signed itself, copied back later or under another name.

:func:`write` returns the keys written. Each key is meant to be named by the job's log
("control store key ...: not signed with this job's secret"), and no probe may make the job act.
"""
from __future__ import annotations

import time

from ..control import auth, keys, messages

LOOKS_SIGNED = "hs1." + "0" * 64 + "."
"""The prefix of a value that looks signed and is not."""
MALFORMED = LOOKS_SIGNED + "{not json"

FAMILIES = ("plan", "prepare", "order", "ready", "hb", "hb_timeout", "node_hb", "alarm", "exited", "abort",
            "shutdown", "finished", "trained", "caught_up", "unfit", "job_id", "fingerprint", "handover", "drain",
            "drained", "moved", "compute", "stragglers", "fail", "spare", "wait", "kill")
"""Every key family of the control store (:mod:`hotspare.control.keys`)."""

AT_RECOVERY = ("plan", "prepare", "order", "ready", "caught_up", "fail", "spare", "wait")
"""Families the job reads only when a failure is being handled: named in the probes' ``+kill``
runs."""
NOT_READ_WHILE_FORGED = ("job_id", "fingerprint", "hb_timeout", "trained", "compute", "stragglers", "node_hb",
                         "finished", "exited", "unfit", "moved")
"""Families the job does not read while a probe's value sits there, so its log need not name it:
``job_id``, ``fingerprint`` are read when a launcher or worker joins, ``hb_timeout`` when a worker
starts beating, ``trained`` when a failure comes (it was set at the first step), ``compute`` and
``stragglers`` only with straggler detection on, ``node_hb`` only with several launchers
(``--nnodes``; the hosts mode); ``finished``, ``exited`` are written by the job itself before
anyone reads them (the rank's end, the failed worker's exit) and ``unfit`` is read when that spare
exits; ``moved`` only by a ``hotspare-run drain --rank`` command. Overwriting one of them is a
denial of service at worst (docs/control-plane.md), never an action: every probe must still end
bitwise."""


class Target:
    """The names a probe writes under: the last rank (on the last node), node 1's spare."""

    def __init__(self, world: int, nodes: int = 2):
        self.world, self.rank = world, world - 1
        self.live = keys.active_id(world - 1)
        self.spare = keys.spare_id(nodes - 1, 0)
        self.node = nodes - 1


def key_of(family: str, t: Target) -> str:
    """The store key a probe of single-value ``family`` writes."""
    single = {"plan": keys.plan(1), "prepare": keys.prepare(t.spare), "order": keys.order(t.spare),
              "ready": keys.ready(t.spare), "hb": keys.heartbeat(t.live), "hb_timeout": keys.heartbeat_timeout(t.live),
              "node_hb": keys.node_heartbeat(t.node), "alarm": keys.alarm(0, t.live), "exited": keys.exited(t.live),
              "abort": keys.ABORT, "shutdown": keys.SHUTDOWN, "finished": keys.finished(t.rank),
              "trained": keys.TRAINED, "caught_up": keys.caught_up(1), "unfit": keys.unfit(t.spare),
              "job_id": keys.JOB_ID, "fingerprint": keys.FINGERPRINT, "compute": keys.compute(t.live),
              "drained": keys.drained(t.node), "moved": keys.moved(t.rank),
              "stragglers": keys.STRAGGLERS}
    if family not in single:
        raise ValueError(f"{family!r} is not a single-value key family ({', '.join(sorted(single))})")
    return single[family]


LISTS = {"handover": (keys.HANDOVER_COUNT, keys.HANDOVER), "drain": (keys.DRAIN_COUNT, keys.DRAIN),
         "fail": (keys.FAIL_COUNT, keys.FAIL), "spare": (keys.SPARE_COUNT, keys.SPARE),
         "wait": (keys.WAIT_COUNT, keys.WAIT), "kill": (keys.KILL_COUNT, keys.KILL)}


def well_formed(family: str, t: Target) -> str:
    """The value the job itself would write for ``family`` at ``t`` (unsigned)."""
    now = time.time()
    values = {
        "plan": lambda: messages.Plan(1, t.world, {str(r): keys.active_id(r) for r in range(t.world)},
                                      replaced={str(t.rank): t.spare}).to_json(),
        "prepare": lambda: messages.to_json(messages.Prepare(rank=t.rank, world_size=t.world, generation=1,
                                                             replaces=t.live)),
        "order": lambda: "1", "ready": lambda: keys.SPARE_ANY, "hb": lambda: str(1 << 40),
        "hb_timeout": lambda: "1e9", "node_hb": lambda: str(1 << 40), "alarm": lambda: "1",
        "exited": lambda: "-9", "abort": lambda: "forged: state lost", "shutdown": lambda: "1",
        "finished": lambda: t.live, "trained": lambda: "1", "caught_up": lambda: "100",
        "unfit": lambda: "forged: cannot take a rank", "job_id": lambda: "forged-job",
        "fingerprint": lambda: "forged", "stragglers": lambda: messages.to_json(messages.StragglerPolicy(1.01, 2)),
        "compute": lambda: messages.to_json(messages.Compute(0, [{"step": s, "seconds": 100.0} for s in range(8)])),
        "handover": lambda: messages.to_json(messages.Handover(worker=keys.active_id(0), rank=0, cause="straggler")),
        "drain": lambda: messages.to_json(messages.Drain(node=0)),
        "drained": lambda: "1", "moved": lambda: f"moved to {t.spare}",
        "fail": lambda: messages.to_json(messages.Failure(worker=t.live, rank=t.rank, code=-9, reason="exit",
                                                          wall_time=now)),
        "spare": lambda: messages.to_json(messages.Spare(worker="s0.7", node=0)),
        "wait": lambda: messages.to_json(messages.Waiting(worker=keys.active_id(0), rank=0, generation=0)),
        "kill": lambda: messages.to_json(messages.Kill(worker=keys.active_id(0))),
    }
    return values[family]()


def _stranger_signer(store) -> auth.Signer:
    """A signer with a secret of the stranger's own, under the job's id (which anyone can read)."""
    job_id = ""
    if store.check([keys.JOB_ID]):
        text = store.get(keys.JOB_ID).decode("utf-8", errors="replace")
        job_id = text.split(".", 2)[-1] if text.startswith("hs1.") else ""
    return auth.Signer(auth.new_secret(), job_id)


def _put(store, family: str, t: Target, value_of) -> str:
    if family in LISTS:
        counter, prefix = LISTS[family]
        key = f"{prefix}{store.add(counter, 1) - 1}"
    else:
        key = key_of(family, t)
    store.set(key, value_of(key))
    if family in ("prepare", "order", "shutdown"):  # a waiting spare looks only once woken
        store.set(keys.wake(t.spare), "1")
    return key


WAYS = ("unsigned", "forged", "malformed")


def write(store, way: str, families, t: Target) -> list[str]:
    """Write ``way`` (one of :data:`WAYS`) into each of ``families``; the keys written."""
    if way == "unsigned":
        return [_put(store, f, t, lambda key, f=f: well_formed(f, t)) for f in families]
    if way == "malformed":
        return [_put(store, f, t, lambda key: MALFORMED) for f in families]
    if way == "forged":
        stranger = _stranger_signer(store)
        return [_put(store, f, t, lambda key, f=f: stranger.sign(key, well_formed(f, t))) for f in families]
    raise ValueError(f"{way!r}: not one of {', '.join(WAYS)}")


def holes(store) -> list[str]:
    """Each list's public counter moved on, with no entry written: the keys counted."""
    return [f"{prefix}{store.add(counter, 1) - 1}" for counter, prefix in LISTS.values()]


def must_name(way: str, families, kill: bool, written: list[str], t: Target) -> list[str]:
    """Of the keys ``written``, those the job reads (so its log must name them): all but
    :data:`NOT_READ_WHILE_FORGED`, and without a failure (no ``kill``) those read only during a
    recovery (:data:`AT_RECOVERY`)."""
    if way in ("replay", "hole"):
        return written
    skip = set(NOT_READ_WHILE_FORGED) | (set() if kill else set(AT_RECOVERY))
    return [key for family, key in zip(families, written) if family not in skip]


def replay(store, t: Target, wait_s: float = 3.0) -> list[str]:
    """Copy the job's own signed values: the last rank's heartbeat and node 1's back ``wait_s``
    later (older sequences: not news, so not named), and values signed for one key under another
    (a heartbeat number as generation 1's plan and as a spare's order, a spare's ready word as
    ``shutdown``); the keys moved to, each of which the job must name."""
    beats = [keys.heartbeat(t.live), keys.node_heartbeat(t.node)]
    old = {k: store.get(k) for k in beats if store.check([k])}
    time.sleep(wait_s)
    for k, v in old.items():
        store.set(k, v)
    moved = {keys.plan(1): keys.heartbeat(keys.active_id(0)), keys.order(t.spare): keys.heartbeat(keys.active_id(1)),
             keys.SHUTDOWN: keys.ready(keys.spare_id(0, 0))}
    written = []
    for to, frm in moved.items():
        if store.check([frm]):
            store.set(to, store.get(frm))
            written.append(to)
    store.set(keys.wake(t.spare), "1")
    return written
