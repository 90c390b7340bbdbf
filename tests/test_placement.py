"""Placement properties (pure function, one CPU): off-node holders, balanced load, stability."""
from __future__ import annotations

import itertools
import random

import pytest

from hotspare.placement import place, ring_order, sources_of


def layouts():
    """Equal and unequal node layouts, in shuffled rank order."""
    rng = random.Random(0)
    for sizes in [(2, 2), (4, 4), (1, 1, 1), (3, 3, 3), (2, 2, 2, 2), (8,) * 4, (3, 2), (4, 1, 3), (5, 5, 2)]:
        nodes = [n for n, size in enumerate(sizes) for _ in range(size)]
        yield sizes, nodes
        shuffled = nodes[:]
        rng.shuffle(shuffled)
        yield sizes, shuffled


@pytest.mark.parametrize("replicas", [1, 2])
def test_holders_are_on_other_nodes_and_distinct(replicas):
    for sizes, nodes in layouts():
        if replicas > min(len(nodes) - s for s in sizes):
            continue
        holders = place(nodes, replicas)
        for src, hs in holders.items():
            assert len(hs) == replicas and len(set(hs)) == replicas and src not in hs
            assert all(nodes[h] != nodes[src] for h in hs), (sizes, nodes, src, hs)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_load_is_balanced_on_equal_nodes(replicas):
    for sizes, nodes in layouts():
        if len(set(sizes)) != 1 or replicas > len(nodes) - sizes[0]:
            continue
        holders = place(nodes, replicas)
        loads = [len(sources_of(holders, r)) for r in range(len(nodes))]
        assert set(loads) == {replicas}, (sizes, loads)


def test_load_stays_close_on_unequal_nodes():
    for sizes, nodes in layouts():
        if len(set(sizes)) == 1:
            continue
        loads = [len(sources_of(place(nodes, 1), r)) for r in range(len(nodes))]
        assert max(loads) <= 3, (sizes, loads)


def test_stable_across_a_rebuild_and_deterministic():
    nodes = [0, 0, 1, 1, 2, 2]
    assert place(nodes, 1) == place(list(nodes), 1)
    # A spare taking rank 3's id on rank 3's node: the rebuilt job has the same map, same plan.
    assert place(nodes, 2) == place(tuple(nodes), 2)
    # A spare from another node (rank 3 now on node 2): with the previous plan passed in, only
    # the pairs the move made invalid change, and the result is still valid and balanced.
    before = place(nodes, 1)
    moved = [0, 0, 1, 2, 2, 2]
    after = place(moved, 1, previous=before)
    broken = {s for s, hs in before.items() if any(moved[h] == moved[s] for h in hs)}
    assert broken and all(after[s] == before[s] for s in before if s not in broken)
    assert all(moved[h] != moved[s] for s, hs in after.items() for h in hs)
    assert max(len(sources_of(after, r)) for r in range(6)) <= 2


def test_single_node_falls_back_to_other_local_ranks():
    assert place([0, 0, 0, 0], 1) == {0: [1], 1: [2], 2: [3], 3: [0]}


def test_ring_alternates_nodes():
    assert ring_order([0, 0, 1, 1]) == [0, 2, 1, 3]
    assert ring_order([1, 0, 1, 0]) == [1, 0, 3, 2]


@pytest.mark.parametrize("nodes, replicas, message", [
    ([0, 0, 1, 1], 3, "cannot be placed off-node"),
    ([0, 1], 2, "needs at least 3 ranks"),
    ([0, 1], -1, "must be >= 0"),
])
def test_impossible_placements_are_refused(nodes, replicas, message):
    with pytest.raises(ValueError, match=message):
        place(nodes, replicas)


def test_zero_replicas_places_nothing():
    assert place([0, 1], 0) == {0: [], 1: []}
    assert all(not v for v in itertools.chain(place([0, 0, 1], 0).values()))


def megatron_stages(pp: int, dp: int) -> list[int]:
    """megatron-core's rank order (tp=1): rank r is in stage r // dp."""
    return [r // dp for r in range(pp * dp)]


@pytest.mark.parametrize("pp,dp,per_node", [(2, 3, 2), (2, 2, 1), (3, 2, 2), (2, 4, 2), (4, 2, 2)])
def test_pipeline_stages_mirror_away_from_the_nodes_of_their_own_stage(pp, dp, per_node):
    """Losing any one node never leaves a single node holding both the last live replicas of a
    stage and the mirrors of that stage's lost ranks, when another placement exists."""
    stages = megatron_stages(pp, dp)
    nodes = [r // per_node for r in range(pp * dp)]
    holders = place(nodes, 1, stage_of_rank=stages)
    for src, (h,) in holders.items():
        assert nodes[h] != nodes[src]
        others = {nodes[r] for r in range(len(nodes)) if stages[r] == stages[src]}
        if len(set(nodes)) > len(others):  # some node holds no rank of this stage
            assert nodes[h] not in others, (src, h)
    for lost in set(nodes):
        for stage in set(stages):
            gone = [r for r in range(len(nodes)) if stages[r] == stage and nodes[r] == lost]
            live = {nodes[r] for r in range(len(nodes)) if stages[r] == stage and nodes[r] != lost}
            mirrors = {nodes[holders[r][0]] for r in gone}
            if gone and len(live) == 1 and len(set(nodes)) > 2:
                assert mirrors != live, (lost, stage)


def test_without_stages_the_ring_placement_is_unchanged():
    nodes = [0, 0, 1, 1, 2, 2]
    assert place(nodes, 1, stage_of_rank=[0] * 6) == place(nodes, 1)
