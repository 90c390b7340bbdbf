"""The coordinator's spares: which are registered and ready, which may take only a rank of their
own node (an accelerator's), and which nodes are avoided (a straggler ran there). Which spare
takes which rank is the pure :func:`hotspare.control.choose_spares`; this holds what it is fed.
"""
from __future__ import annotations

from collections.abc import Callable

from . import control

STARTING_S = 120.0
"""How long a registered spare that is not ready yet counts as starting (the straggler watch sets
the steps meanwhile aside); one that takes longer is not waited for."""


class Spares:
    """``store``: the control store; ``homes``: the nodes that hold ranks at the start; ``off()``:
    the nodes whose spares take no rank now (lost, or being drained); ``log``: a log line."""

    def __init__(self, store, homes: set[int], off: Callable[[], set[int]], log: Callable[[str], None]):
        self.store, self.homes, self.off, self.log = store, homes, off, log
        self.registered: list[tuple[str, int]] = []
        """(worker id, node) of every spare registered and not promoted, failed or given up."""
        self.slow_nodes: set[int] = set()
        """Nodes a straggler ran on: their spares are taken last (``choose_spares``' ``avoid``)."""
        self._scope: dict[str, str] = {}  # ready spare -> control.SPARE_LOCAL or SPARE_ANY (what it said)
        self._since: dict[str, float] = {}  # spare -> when it was first seen registered and not ready

    def add(self, spares) -> None:
        self.registered += [(s.worker, s.node) for s in spares]

    def drop(self, wids) -> None:
        """Spares promoted, failed, or on a node given up."""
        self.registered = [s for s in self.registered if s[0] not in wids]

    def drop_node(self, node: int) -> None:
        self.registered = [s for s in self.registered if s[1] != node]

    def ready(self) -> list[tuple[str, int]]:
        """Registered spares that wait for an order (imports done, model built), off no node."""
        off = self.off()
        return [s for s in self.registered if s[1] not in off and self.store.is_ready(s[0])]

    def starting(self, now: float) -> bool:
        """Whether a spare is starting: registered (a successor is registered when its
        predecessor is promoted) and not ready yet, for at most :data:`STARTING_S` since first
        seen so. Its imports and model build compete for its node's CPUs."""
        off = self.off()
        for wid, node in self.registered:
            if node in off or self.store.is_ready(wid):
                continue
            if now - self._since.setdefault(wid, now) < STARTING_S:
                return True
        return False

    def local_only(self, ready: list[tuple[str, int]]) -> set[str]:
        """The ready spares that may take only a rank of their own node (what each said in
        ``ready/<wid>``; read once per spare). A spare on a node that holds no rank (a replacement
        node started with ``--spares-only``) has its devices free, and may take any node's rank."""
        for wid, _ in ready:
            if wid not in self._scope:
                self._scope[wid] = self.store.ready_scope(wid) or control.SPARE_ANY
        return {wid for wid, node in ready if self._scope[wid] == control.SPARE_LOCAL and node in self.homes}

    def choose(self, dead: dict[int, int], ready: list[tuple[str, int]]) -> dict[int, str] | None:
        """``choose_spares`` over ``ready``, slow nodes avoided."""
        return control.choose_spares(dead, ready, self.local_only(ready), self.slow_nodes)

    def can_take(self, rank: int, node: int) -> bool:
        """Whether a ready spare can take ``rank``, which runs on ``node``."""
        ready = self.ready()
        return control.choose_spares({rank: node}, ready, self.local_only(ready)) is not None

    def note_slow(self, failure: control.Failure, node: int, stragglers: set[str]) -> None:
        """A straggler (one of ``stragglers``, the workers the straggler watch asked) left its rank
        on ``node``: the node may be the slow part (a throttled or shared host), so from now on its
        spares take a rank only when no other node's can, and its ranks go to other nodes first.
        A drained rank's node is not suspect."""
        if failure.reason != "handover" or failure.worker not in stragglers or node in self.slow_nodes:
            return
        self.slow_nodes.add(node)
        self.log(f"node {node} is avoided for spares from now on: rank {failure.rank} ({failure.worker}) was a "
                 f"straggler there; its spares take a rank only when no other node's can")
