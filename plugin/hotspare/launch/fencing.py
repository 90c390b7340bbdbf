"""A node's heartbeat to node 0, and fencing: a launcher cut off from the control store for
``--node-timeout-s`` stops its own workers (nothing acts on a stale view of the job)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .. import control
from ..control.auth import Signer
from .spec import LaunchSpec


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
                beats += 1
                store.beat_node(s.node_rank, beats)
                self._ok = time.monotonic()
            except Exception:  # noqa: BLE001 - any failure to reach the store counts as silence
                store = None
