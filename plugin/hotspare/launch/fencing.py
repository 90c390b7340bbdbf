"""A node's heartbeat to node 0, and fencing: a launcher cut off from the control store for
``--node-timeout-s`` stops its own workers (nothing acts on a stale view of the job)."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

from .. import control
from ..control.auth import Signer
from .exits import FENCED_EXIT_CODE, say_exit
from .processes import log, signal_group
from .spec import LaunchSpec

FENCE_GRACE_S = 2.0
"""Fencing: the longest a keeper gets to remove its segments before it is killed (not the whole
``term_grace_s``). The watch looks every tenth of ``--node-timeout-s``, so with the default flags
(10 s) every process of a fenced node is SIGKILLed within 10 + 1 + 2 = 13 s of its last contact
with node 0 (the promise: gone within 15 s; a large trainer's teardown takes the rest)."""


def fence(spec: LaunchSpec, workers: Iterable, keepers, silent_s: float, why: str = ""):
    """Stop every worker and keeper of this node, so that nothing acts on a stale view of the job
    (node 0 has declared this node lost and given its ranks to spares by now), say so in the
    last line, and exit with FENCED_EXIT_CODE. Every worker's session is killed, also one whose
    leader exited: it may have left children in it (DataLoader workers, a checkpoint writer)."""
    lost = why or f"for {silent_s:.1f} s (partitioned from node 0, or node 0 is down)"
    where = f"the control store at {spec.master_addr}:{spec.master_port}"
    log(f"node {spec.node_rank} cannot reach {where} {lost}: stopping this node's workers (fenced), "
        f"exit code {FENCED_EXIT_CODE}")
    for w in workers:
        signal_group(w.proc, signal.SIGKILL)
    keepers.stop(min(spec.term_grace_s, FENCE_GRACE_S))
    say_exit(FENCED_EXIT_CODE, f"node {spec.node_rank} fenced itself: it cannot reach {where} {lost}; its "
                               f"workers and keepers are stopped")
    os._exit(FENCED_EXIT_CODE)


class NodeBeat:
    """Nodes other than 0: beat ``node/<n>/hb`` (a signed set: the store's reply proves it arrived)
    over a connection of its own, and call ``on_fence(silent_s)`` when the store has been out of
    reach for ``node_timeout_s``. A call to a store behind a cut link can block for a long time,
    so a watch thread of its own measures the silence."""

    def __init__(self, spec: LaunchSpec, signer: Signer, on_fence: Callable[[float], None]):
        self.spec, self.signer, self.on_fence = spec, signer, on_fence
        self.interval = max(0.1, spec.node_timeout_s / 10)
        self._stop = threading.Event()
        self._ok = time.monotonic()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="hotspare-node-fence", daemon=True).start()
        threading.Thread(target=self._beat, name="hotspare-node-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            silent = time.monotonic() - self._ok
            if silent > self.spec.node_timeout_s:
                self.on_fence(silent)

    def _beat(self) -> None:
        from ..generation import connect_store

        s = self.spec
        store, beats = None, 0
        while not self._stop.wait(self.interval):
            try:
                if store is None:
                    store = control.ControlStore(connect_store(s.master_addr, s.master_port, s.node_timeout_s),
                                                 self.signer)
                    # Node 0 counts a beat only past the last it counted: go on from the store's.
                    beats = max(beats, store.node_beats(s.node_rank))
                beats += 1
                store.beat_node(s.node_rank, beats)
                self._ok = time.monotonic()
            except Exception:  # noqa: BLE001 - any failure to reach the store counts as silence
                store = None
