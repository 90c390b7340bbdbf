"""The control plane: what launchers, the coordinator and workers tell each other through the
control store. Keys and worker ids in :mod:`.keys`, the typed messages in :mod:`.messages`, the
operations in :class:`ControlStore` (the only code that reads or writes a control key).
Values are small JSON documents or integers; nothing here carries state bytes.
"""
from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence

from . import keys
from .keys import SPARE_ANY, SPARE_LOCAL, WorkerId, active_id, is_worker_id, parse_worker_id, spare_id
from .messages import BadMessage, Compute, Drain, Failure, Handover, Kill, Plan, Prepare, Sample, Spare, StragglerPolicy, Waiting
from .store import WAKE_WAIT, ControlStore, ListCursor

__all__ = ["keys", "SPARE_ANY", "SPARE_LOCAL", "WorkerId", "active_id", "is_worker_id", "parse_worker_id", "spare_id",
           "BadMessage", "Failure", "Kill", "Plan", "Prepare", "Spare", "Waiting", "WAKE_WAIT", "ControlStore", "ListCursor",
           "STACKS_SIGNAL", "RECOVERY_POLL_S", "choose_spares", "Compute", "Drain", "Handover", "Sample", "StragglerPolicy",
           "HANDOVER_SIGNAL", "HANDED_OVER_EXIT_CODE"]

STACKS_SIGNAL = signal.SIGRTMIN + 3
"""hotspare-run sends it to a worker it is about to kill as stuck: the worker writes every
thread's Python stack to its stderr (faulthandler, from the signal handler itself, so a thread
blocked inside C++ is shown too), and the log says where it was stuck. A real-time signal: the
usual ones (SIGUSR1/2) are a scheduler's to send."""

HANDOVER_SIGNAL = signal.SIGRTMIN + 4
"""hotspare-run sends it to a worker the coordinator asked to hand over (``handover/<i>``): the
worker leaves at its next step boundary, once the state of the step it completed is protected
(hotspare.session.handover)."""

HANDED_OVER_EXIT_CODE = 75
"""A worker that handed its rank over exits with it; its launcher (which asked) reports the exit as
a handover, not a failure."""

RECOVERY_POLL_S = 0.005
"""How often a polled wait on a recovery's path looks (the new generation's members; the
launcher while a failure waits for its plan): these waits last a fraction of a second and their
poll delay adds up into the recovery's time."""


def choose_spares(dead: Mapping[int, int], spares: Sequence[tuple[str, int]],
                  local_only: frozenset[str] | set[str] = frozenset(),
                  avoid: frozenset[int] | set[int] = frozenset()) -> dict[int, str] | None:
    """Which spare takes which dead rank: a pure function.

    ``dead``: rank -> node of each failed active rank; ``spares``: (worker id, node) of each
    ready spare, in registration order; ``local_only``: spares that may take only a rank of
    their own node (``SPARE_LOCAL``). A spare on the dead rank's own node is preferred (its
    launcher owns the rank's device and, later, its keeper); otherwise the spare of the node
    with most spares left. ``avoid``: nodes found slow (a straggler ran there): their spares are
    taken last, and a rank of such a node takes another node's spare first. Avoiding never
    leaves a rank without a spare that the plain rule would give it. Returns None when the
    spares cannot cover the dead ranks.
    """
    if len(spares) < len(dead):
        return None
    if avoid:
        out = _choose(dead, spares, local_only, frozenset(avoid))
        if out is not None:
            return out
    return _choose(dead, spares, local_only, frozenset())


def _choose(dead, spares, local_only, avoid) -> dict[int, str] | None:
    left = list(spares)
    out: dict[int, str] = {}
    elsewhere = []
    for rank in sorted(dead):  # every rank that has one takes a spare of its own node first
        same = [s for s in left if s[1] == dead[rank] and s[1] not in avoid]
        if same:
            out[rank] = same[0][0]
            left.remove(same[0])
        else:
            elsewhere.append(rank)
    # The ranks of avoided nodes last: they may fall back to their own node's spare.
    for rank in sorted(elsewhere, key=lambda r: dead[r] in avoid):
        can = [s for s in left if s[0] not in local_only or s[1] == dead[rank]]
        if not can:
            return None
        count = {n: sum(1 for _, m in left if m == n) for _, n in left}
        pick = min(can, key=lambda s: (s[1] in avoid, -count[s[1]], left.index(s)))
        out[rank] = pick[0]
        left.remove(pick)
    return dict(sorted(out.items()))


