"""Every key of the control store, spelled once, and the worker ids.

The keys live in the launcher-owned TCPStore (see :mod:`hotspare.generation`), outside any
generation's prefix, so they survive rebuilds. Only :class:`hotspare.control.ControlStore` reads
and writes them (a generation's rendezvous keys under ``gen/<g>/`` are
:mod:`hotspare.generation`'s).

- ``fail/<tag>/count``, ``fail/<tag>/<i>``: failures seen by any launcher (a worker exited, or
  missed its heartbeats and was killed), appended with an atomic counter
  (:class:`~.messages.Failure`). ``<tag>`` is derived from the job's secret: a list's keys are
  names a stranger cannot find (:mod:`.lists`); the public ``fail/count``, ``fail/<i>`` are only
  looked at to name what a stranger wrote there. The same for the other lists below.
- ``spare/<tag>/count``, ``spare/<tag>/<i>``: spares registered by their launchers (:class:`~.messages.Spare`).
- ``ready/<wid>``: set by a spare once it waits for an order (imports done, model built); the
  value says which ranks it can take (:data:`SPARE_ANY`, :data:`SPARE_LOCAL`).
- ``hb/<wid>``: a worker's heartbeat sequence (it only goes up; a goodbye is its negative);
  ``hb/<wid>/timeout`` its allowed silence in seconds (finite, > 0).
- ``node/<n>/hb``: node n's launcher's heartbeat sequence (it only goes up).
- ``plan/<g>``: the coordinator's plan for generation g (:class:`~.messages.Plan`).
- ``prepare/<wid>``: sent to a spare as soon as a failure is reported (:class:`~.messages.Prepare`):
  build that rank's engine now; the plan that follows gives it that rank.
- ``order/<wid>``: a spare's takeover order: the generation it joins (the plan says as whom).
- ``wake/<wid>``: set after anything a waiting spare must read (its prepare, its order,
  ``shutdown``); the spare blocks on it in the store.
- ``shutdown``: training finished; spares exit.
- ``alarm/<g>/<wid>``: set by the coordinator for every worker of generation g the moment it
  learns that g failed; each worker blocks on its own key in a thread and leaves g at once; a
  worker sets its own key (to ``closed``) to end that wait when it closes.
- ``exited/<wid>``: a failed worker's process is gone (its exit code); a spare that takes its
  device waits for this.
- ``abort``: set by a worker that found the job unrecoverable (the message says what was lost);
  every launcher stops its workers and exits with ``launch.ABORT_EXIT_CODE``.
- ``wait/<tag>/count``, ``wait/<tag>/<i>``: a survivor that saw a failure and left its generation says so
  (:class:`~.messages.Waiting`).
- ``kill/<tag>/count``, ``kill/<tag>/<i>``: the coordinator asks a worker's launcher to kill it as hung
  (:class:`~.messages.Kill`).
- ``handover/<tag>/count``, ``handover/<tag>/<i>``: the coordinator asks a worker's launcher to
  hand it over to a spare at its next step boundary (:class:`~.messages.Handover`).
- ``drain/<tag>/count``, ``drain/<tag>/<i>``: an operator's ``hotspare-run drain`` asks that every
  rank on a node, or one rank, move to spares elsewhere (:class:`~.messages.Drain`);
  ``drained/<n>``: the coordinator's word that no rank of the job runs on node n any more;
  ``moved/<rank>``: that a drained rank runs in another worker now (its id), or why it cannot.
- ``stragglers``: rank 0's word that the job looks for slow ranks, with the test's parameters
  (:class:`~.messages.StragglerPolicy`); ``compute/<wid>``: a worker's latest compute times per
  step (:class:`~.messages.Compute`).
- ``caught_up/<g>``: set by rank 0 of generation g once training is back at the step the failure
  interrupted; the launchers start the successors of g's promoted spares then.
- ``trained``: set by rank 0 once the job's first step completed (a failure before it is likely
  the script's).
- ``finished/<rank>``: rank's script exited 0 (the worker id that held it); the job finished
  once every rank did, and only then does node 0 set ``shutdown``.
- ``unfit/<wid>``: why spare ``wid`` cannot take a rank (its set-up failed deterministically).
- ``job/id``, ``job/fingerprint``: the job's identity (:mod:`hotspare.identity`).

Worker ids: ``a<rank>`` for the ranks started active, ``s<node>.<k>`` for spares.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# The lists' prefixes, and their public counters (a stranger's: the job counts under a private name).
FAIL_COUNT, FAIL = "fail/count", "fail/"
SPARE_COUNT, SPARE = "spare/count", "spare/"
WAIT_COUNT, WAIT = "wait/count", "wait/"
KILL_COUNT, KILL = "kill/count", "kill/"
HANDOVER_COUNT, HANDOVER = "handover/count", "handover/"
DRAIN_COUNT, DRAIN = "drain/count", "drain/"
STRAGGLERS = "stragglers"
ABORT = "abort"
SHUTDOWN = "shutdown"
TRAINED = "trained"
JOB_ID = "job/id"
FINGERPRINT = "job/fingerprint"

SPARE_ANY = "any"
"""``ready/<wid>``: the spare can take a rank of any node (CPU: no device to own)."""
SPARE_LOCAL = "local"
"""``ready/<wid>``: the spare can take only a rank of its own node (an accelerator: it takes the
dead rank's device, and another node's devices all belong to live ranks)."""


def plan(generation: int) -> str:
    return f"plan/{generation}"


def ready(wid: str) -> str:
    return f"ready/{wid}"


def prepare(wid: str) -> str:
    return f"prepare/{wid}"


def order(wid: str) -> str:
    return f"order/{wid}"


def wake(wid: str) -> str:
    return f"wake/{wid}"


def heartbeat(wid: str) -> str:
    return f"hb/{wid}"


def drained(node: int) -> str:
    return f"drained/{node}"


def moved(rank: int) -> str:
    return f"moved/{rank}"


def compute(wid: str) -> str:
    return f"compute/{wid}"


def heartbeat_timeout(wid: str) -> str:
    return f"hb/{wid}/timeout"


def node_heartbeat(node: int) -> str:
    return f"node/{node}/hb"


def alarm(generation: int, wid: str) -> str:
    return f"alarm/{generation}/{wid}"


def exited(wid: str) -> str:
    return f"exited/{wid}"


def finished(rank: int) -> str:
    return f"finished/{rank}"


def unfit(wid: str) -> str:
    return f"unfit/{wid}"


def caught_up(generation: int) -> str:
    return f"caught_up/{generation}"


def generation_prefix(generation: int) -> str:
    """The prefix of generation g's own keys (its process groups' rendezvous)."""
    return f"gen/{generation}/"


def arrived(generation: int, rank: int) -> str:
    """A member's arrival in generation g's rendezvous (under the generation's prefix)."""
    return f"{generation_prefix(generation)}arrived/{rank}"


def active_id(rank: int) -> str:
    return f"a{rank}"


def spare_id(node: int, k: int) -> str:
    return f"s{node}.{k}"


_ACTIVE = re.compile(r"a(0|[1-9][0-9]{0,6})")
_SPARE = re.compile(r"s(0|[1-9][0-9]{0,6})\.(0|[1-9][0-9]{0,6})")


@dataclass(frozen=True)
class WorkerId:
    """A parsed worker id: ``rank`` for one started active, ``node`` and ``k`` for a spare."""

    text: str
    rank: int = -1
    node: int = -1
    k: int = -1

    @property
    def spare(self) -> bool:
        return self.node >= 0


def parse_worker_id(text: str) -> WorkerId:
    """``a<rank>`` or ``s<node>.<k>``; ValueError naming the text otherwise."""
    if isinstance(text, str):
        m = _ACTIVE.fullmatch(text)
        if m:
            return WorkerId(text, rank=int(m.group(1)))
        m = _SPARE.fullmatch(text)
        if m:
            return WorkerId(text, node=int(m.group(1)), k=int(m.group(2)))
    raise ValueError(f"{text!r} is not a worker id (a<rank> or s<node>.<k>)")


def is_worker_id(text) -> bool:
    try:
        parse_worker_id(text)
    except ValueError:
        return False
    return True
