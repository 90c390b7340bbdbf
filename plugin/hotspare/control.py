"""The control plane: what launchers and workers tell each other through the control store.

Every key lives in the launcher-owned TCPStore (see :mod:`hotspare.generation`), outside any
generation's prefix, so it survives rebuilds. Values are small JSON documents or integers;
nothing here carries state bytes.

Keys:
- ``fail/count``, ``fail/<i>``: failures seen by any launcher (a worker exited, or missed its
  heartbeats and was killed), appended with an atomic counter.
- ``spare/count``, ``spare/<i>``: spares registered by their launchers (worker id and node).
- ``ready/<wid>``: set by a spare once it waits for an order (imports done, model built).
- ``hb/<wid>``: a worker's heartbeat counter; ``hb/<wid>/timeout`` its allowed silence.
- ``plan/<g>``: the coordinator's plan for generation g (JSON, see :class:`Plan`).
- ``prepare/<wid>``: sent to a spare as soon as a failure is reported (JSON ``{"rank",
  "world_size", "generation"}``): build that rank's engine now; the plan that follows gives it
  that rank (and ``order/<wid>`` follows).
- ``order/<wid>``: a spare's takeover order: the generation it joins (the plan says as whom).
- ``wake/<wid>``: set after anything a waiting spare must read (``prepare/<wid>``,
  ``order/<wid>``, ``shutdown``); the spare blocks on it in the store (:func:`hotspare.worker.wait_for_order`),
  so it learns of its order the moment it is written instead of at its next poll.
- ``shutdown``: training finished; spares exit.
- ``alarm/<g>/<wid>``: set by the coordinator for every worker of generation g the moment it
  learns that g failed (a failure reported, a survivor that left it, the next plan written):
  each worker blocks on its own key in a thread (:class:`hotspare.worker.Heartbeat`) and
  leaves g at once (breaks its connections) instead of waiting for its collectives to fail;
  a worker sets its own key to end that wait when it closes.
- ``exited/<wid>``: a failed worker's process is gone (its exit code); a failure is reported
  when the exit *begins*, before the kernel has torn down the process's memory, so a spare
  that takes its device waits for this.
- ``abort``: set by a worker that found the job unrecoverable (the message says what was
  lost); every launcher stops its workers and exits with ``launch.ABORT_EXIT_CODE``.
- ``wait/count``, ``wait/<i>``: a survivor that saw a failure and left generation g says so
  (:class:`Waiting`); a failure no launcher saw (a collective that timed out because a rank is
  stuck while its heartbeat goes on) is found from who is missing here.
- ``kill/count``, ``kill/<i>``: the coordinator asks a worker's launcher to kill it as hung
  (JSON ``{"worker", "detect_s"}``); the launcher reports it as a 'watchdog' failure.
- ``caught_up/<g>``: set by rank 0 of generation g once training is back at the step the failure
  interrupted (the replayed steps done); the launchers start the successors of g's promoted
  spares then (:class:`hotspare.launch.Launcher`).

Worker ids: ``a<rank>`` for the ranks started active, ``s<node>.<k>`` for spares.
"""
from __future__ import annotations

import datetime
import json
import signal
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

FAIL_COUNT = "fail/count"
WAIT_COUNT = "wait/count"
KILL_COUNT = "kill/count"
ABORT = "abort"
SPARE_COUNT = "spare/count"
SHUTDOWN = "shutdown"
WAKE_WAIT = datetime.timedelta(days=7)
"""A blocking wait that has no end of its own (a spare's on ``wake/<wid>``, a worker's on its
alarm): without limit in practice, and short of poll()'s 2**31 ms."""
STACKS_SIGNAL = signal.SIGRTMIN + 3
"""hotspare-run sends it to a worker it is about to kill as stuck: the worker writes every
thread's Python stack to its stderr (faulthandler, from the signal handler itself, so a thread
blocked inside C++ is shown too), and the log says where it was stuck. A real-time signal: the
usual ones (SIGUSR1/2) are a scheduler's to send."""

RECOVERY_POLL_S = 0.005
"""How often a polled wait on a recovery's path looks (the new generation's members; the
launcher while a failure waits for its plan): these waits last a fraction of a second and their
poll delay adds up into the recovery's time."""


def wake_key(wid: str) -> str:
    return f"wake/{wid}"


def wake(store, wid: str) -> None:
    """Wake spare ``wid`` from its wait (after writing what it must read)."""
    store.set(wake_key(wid), "1")


def alarm_key(generation: int, wid: str) -> str:
    return f"alarm/{generation}/{wid}"


def exited_key(wid: str) -> str:
    return f"exited/{wid}"


TRAINED = "trained"
"""Set by rank 0 once the job's first step completed (a failure before it is likely the script's)."""


def unfit_key(wid: str) -> str:
    """Why spare ``wid`` cannot take a rank (its set-up failed deterministically; setupguard.py)."""
    return f"unfit/{wid}"


def caught_up_key(generation: int) -> str:
    return f"caught_up/{generation}"


def active_id(rank: int) -> str:
    return f"a{rank}"


def spare_id(node: int, k: int) -> str:
    return f"s{node}.{k}"


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
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        return cls(**json.loads(text))

    def rank_of(self, worker: str) -> int | None:
        for rank, wid in self.workers.items():
            if wid == worker:
                return int(rank)
        return None


def current_plan(store, world_size: int) -> Plan:
    """The newest plan in the store (generation 0's, the initial workers, before any failure)."""
    g = 0
    while store.check([f"plan/{g + 1}"]):
        g += 1
    if g == 0:
        return Plan(0, world_size, {str(r): active_id(r) for r in range(world_size)})
    return Plan.from_json(store.get(f"plan/{g}"))


SPARE_ANY = "any"
"""``ready/<wid>``: the spare can take a rank of any node (CPU: no device to own)."""
SPARE_LOCAL = "local"
"""``ready/<wid>``: the spare can take only a rank of its own node (an accelerator: it takes the
dead rank's device, and another node's devices all belong to live ranks)."""


def choose_spares(dead: Mapping[int, int], spares: Sequence[tuple[str, int]],
                  local_only: frozenset[str] | set[str] = frozenset()) -> dict[int, str] | None:
    """Which spare takes which dead rank: a pure function.

    ``dead``: rank -> node of each failed active rank; ``spares``: (worker id, node) of each
    ready spare, in registration order; ``local_only``: spares that may take only a rank of
    their own node (``SPARE_LOCAL``). A spare on the dead rank's own node is preferred (its
    launcher owns the rank's device and, later, its keeper); otherwise the spare of the node
    with most spares left. Returns None when the spares cannot cover the dead ranks.
    """
    if len(spares) < len(dead):
        return None
    left = list(spares)
    out: dict[int, str] = {}
    elsewhere = []
    for rank in sorted(dead):  # every rank that has one takes a spare of its own node first
        same = [s for s in left if s[1] == dead[rank]]
        if same:
            out[rank] = same[0][0]
            left.remove(same[0])
        else:
            elsewhere.append(rank)
    for rank in elsewhere:
        other = [s for s in left if s[0] not in local_only]
        if not other:
            return None
        count = {n: sum(1 for _, m in left if m == n) for _, n in left}
        pick = max(other, key=lambda s: (count[s[1]], -left.index(s)))
        out[rank] = pick[0]
        left.remove(pick)
    return dict(sorted(out.items()))


def append(store, counter: str, prefix: str, value: str) -> int:
    """Append ``value`` to a store list (``<prefix><i>``); returns its index."""
    index = store.add(counter, 1) - 1
    store.set(f"{prefix}{index}", value)
    return index


def read_list(store, counter: str, prefix: str, start: int) -> list[str]:
    """Entries ``start ..`` of a store list that are fully written."""
    n = store.add(counter, 0)
    out = []
    for i in range(start, n):
        key = f"{prefix}{i}"
        if not store.check([key]):
            break  # counted but not written yet: read it on the next poll
        out.append(store.get(key).decode())
    return out


def wait_key(store, key: str, timeout_s: float, what: str) -> bytes:
    """``key``'s value once it is set: blocks in the store (woken the moment it is written, the GIL
    released; no poll delay, and one request per waiter however many wait, where a poll loaded the
    store with each waiter's requests). Raises TimeoutError naming ``what``. torch cancels a wait
    that timed out on the server, so the connection stays usable."""
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # torch.distributed.DistStoreError
        if "timeout" not in str(exc).lower():
            raise
        raise TimeoutError(f"waited {timeout_s:g} s for {what} (store key {key!r})") from None
    return store.get(key)
