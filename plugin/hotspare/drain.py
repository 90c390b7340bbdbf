"""Draining a node: an operator's ``hotspare-run drain --node N`` (signed with the job's secret,
like every control message) asks that every rank on logical node N move to spares on other nodes
without stopping the job (maintenance, a node that misbehaves); ``--rank R`` moves one rank to a
spare (a process that misbehaves), and the coordinator says where it went (``moved/<R>``).

The coordinator (:class:`Drains`, node 0's launcher) stops counting the node's spares as ready,
asks each rank on it, one at a time, to hand over at its next step boundary (``handover/<i>``,
cause 'drain': the same path as a straggler's, so no iteration is lost) as soon as a ready spare
elsewhere can take it, and once no rank of the job runs there says so (``drained/<n>``): the node's launcher then
stops the node's spares and keeper, and the drain command, waiting on that key, says the node is
free. A rank no spare can take stays where it is; that is said once, and the drain goes on when
a spare comes (``hotspare-run --spares-only`` on another node).
"""
from __future__ import annotations

from . import control


class Drains:
    """The coordinator's drains: ``store`` its ControlStore, ``node_of`` the launch spec's
    ``node_of_worker``, ``log`` its log line."""

    def __init__(self, store, node_of, log):
        self.store, self.node_of, self.log = store, node_of, log
        self.nodes: set[int] = set()
        """Nodes being drained or drained: their spares take no rank."""
        self.ranks: dict[int, str] = {}
        """Ranks being drained (``--rank``) -> the worker that held the rank when asked."""
        self._cursor = control.ListCursor(control.keys.DRAIN)
        self._asked: dict[str, int] = {}  # worker asked to hand over -> the generation it was asked in
        self._said: set[str] = set()
        self._free: set[int] = set()

    def look(self, plan, can_take) -> None:
        """``plan``: the current generation's; ``can_take(rank)``: whether a ready spare (off the
        drained nodes) can take ``rank``."""
        for order in self.store.drains(self._cursor)[0]:
            self._take(order, plan)
        # One rank at a time: each takes a spare, and the next may need the successor of that one.
        moving = any(self._asked.get(w) == plan.generation for w in plan.workers.values())
        for rank, was in list(self.ranks.items()):
            now = plan.workers[str(rank)]
            if now != was:  # handed over (or replaced after a failure meanwhile)
                del self.ranks[rank]
                self.store.set_moved(rank, f"moved to {now}")
                self.log(f"drain of rank {rank}: it runs in {now} now ({was} handed it over)")
            elif not moving and self._ask(rank, was, f"rank {rank} is being drained", can_take, plan.generation):
                moving = True
        for node in sorted(self.nodes - self._free):
            on = sorted((int(r), w) for r, w in plan.workers.items() if self.node_of(w) == node)
            if not on:
                self._free.add(node)
                self.store.set_drained(node)
                self.log(f"node {node} is free: no rank of the job runs there")
                continue
            for rank, wid in on:
                if not moving and self._ask(rank, wid, f"node {node} is being drained", can_take, plan.generation):
                    moving = True

    def _take(self, order, plan) -> None:
        if order.rank >= 0:
            if order.rank >= plan.world_size:
                self.store.set_moved(order.rank, f"refused: the job has ranks 0..{plan.world_size - 1}")
                self.log(f"drain of rank {order.rank} refused: the job has ranks 0..{plan.world_size - 1}")
            elif order.rank not in self.ranks:
                self.ranks[order.rank] = plan.workers[str(order.rank)]
                self.log(f"drain of rank {order.rank} asked: it moves to a spare at a step boundary")
        elif order.node >= 0 and order.node not in self.nodes:
            self.nodes.add(order.node)
            self.log(f"drain of node {order.node} asked: its ranks move to spares on other nodes, one step "
                     f"boundary each; its spares take no rank")

    def _ask(self, rank: int, wid: str, why: str, can_take, generation: int) -> bool:
        """Ask ``wid`` to hand ``rank`` over, once per generation (a recovery before it left voids
        the order), when a spare can take it; whether it was asked now."""
        if self._asked.get(wid) == generation:
            return False
        if not can_take(rank):
            if wid not in self._said:
                self._said.add(wid)
                self.log(f"{why}: no ready spare can take rank {rank} ({wid}); it stays until one can")
            return False
        self._asked[wid] = generation
        self.store.ask_handover(control.Handover(wid, rank, "drain", why, generation))
        return True
