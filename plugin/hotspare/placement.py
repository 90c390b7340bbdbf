"""Placement: which peers hold each rank's mirror. A pure function, tested on one CPU.

Ranks are laid on a ring that alternates nodes (node 0's first rank, node 1's first rank, ...,
node 0's second rank, ...). Rank i's j-th replica goes to the j-th rank after it on the ring
that sits on another node and does not already hold a copy of i. With equal-sized nodes this
gives every rank exactly ``replicas`` sources to hold (balanced load) and never pairs two
ranks of one node. The result depends only on the (rank -> node) map, so a rebuild in which
a spare takes a dead rank's id on the same node reproduces the placement exactly; passing the
``previous`` placement keeps every pair that is still valid when a spare comes from another
node, so only the pairs that the move broke are placed anew.

With pipeline stages (``stage_of_rank``), a rank's holders are taken first from nodes that hold
no rank of its own stage: a node's loss then never leaves one node with both the stage's last
live replicas and the mirrors of the ranks it lost, where another placement exists.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence


def ring_order(node_of_rank: Sequence[int]) -> list[int]:
    """Ranks ordered round-robin over nodes (each node's ranks in rank order)."""
    by_node: dict[int, list[int]] = defaultdict(list)
    for rank, node in enumerate(node_of_rank):
        by_node[node].append(rank)
    nodes = sorted(by_node)
    order = []
    for i in range(max(len(v) for v in by_node.values())):
        order.extend(by_node[n][i] for n in nodes if i < len(by_node[n]))
    return order


def place(node_of_rank: Sequence[int], replicas: int,
          previous: dict[int, list[int]] | None = None,
          stage_of_rank: Sequence[int] | None = None) -> dict[int, list[int]]:
    """Holders of each rank's mirror: ``{source rank: [holder ranks]}``.

    Holders are on other nodes whenever another node exists; on a single node they are other
    ranks of it (there is no better choice, and the log says so at start-up).
    """
    num_ranks = len(node_of_rank)
    if replicas < 0:
        raise ValueError(f"replicas={replicas} must be >= 0")
    if replicas >= num_ranks and replicas > 0:
        raise ValueError(f"replicas={replicas} needs at least {replicas + 1} ranks, the job has {num_ranks}")
    order = ring_order(node_of_rank)
    position = {rank: i for i, rank in enumerate(order)}
    single_node = len(set(node_of_rank)) == 1
    foreign = [sum(1 for n in node_of_rank if n != node_of_rank[r]) for r in range(num_ranks)]
    if not single_node and replicas > min(foreign):
        worst = min(range(num_ranks), key=lambda r: foreign[r])
        raise ValueError(f"replicas={replicas} cannot be placed off-node: rank {worst}'s node leaves only "
                         f"{foreign[worst]} ranks elsewhere; lower replicas or add nodes")
    def valid(src: int, holder: int) -> bool:
        return holder != src and 0 <= holder < num_ranks and (single_node or node_of_rank[holder] != node_of_rank[src])

    holders: dict[int, list[int]] = {}
    load = [0] * num_ranks
    if previous:
        for src in range(num_ranks):
            kept = [h for h in previous.get(src, [])[:replicas] if valid(src, h)]
            holders[src] = list(dict.fromkeys(kept))
            for h in holders[src]:
                load[h] += 1
    for src in range(num_ranks):
        chosen = holders.setdefault(src, [])
        if len(chosen) == replicas:
            continue
        start = position[src]
        ring = [order[(start + step) % num_ranks] for step in range(1, num_ranks)]
        candidates = [c for c in ring if valid(src, c) and c not in chosen]
        # Fresh placement: ring order. Repair: the least-loaded valid ranks, ring order on ties.
        if previous:
            candidates.sort(key=lambda c: load[c])
        if stage_of_rank is not None:  # stable: nodes without a replica of the source's stage first
            stage_nodes = {node_of_rank[r] for r in range(num_ranks) if stage_of_rank[r] == stage_of_rank[src]}
            candidates.sort(key=lambda c: node_of_rank[c] in stage_nodes)
        for cand in candidates[:replicas - len(chosen)]:
            chosen.append(cand)
            load[cand] += 1
    return holders


def sources_of(holders: dict[int, list[int]], rank: int) -> list[int]:
    """The ranks whose mirrors ``rank`` holds, in rank order."""
    return sorted(src for src, hs in holders.items() if rank in hs)
