"""Recovery planning (pure): the spare choice, the landing version, the load split."""
from __future__ import annotations

import pytest

from hotspare.control import Plan, choose_spares
from hotspare.planning import KEEPER, SELF, Holdings, NoConsistentVersion, choose_version, split_load


def test_spares_prefer_the_dead_ranks_node():
    spares = [("s0.0", 0), ("s1.0", 1)]
    assert choose_spares({3: 1}, spares) == {3: "s1.0"}
    assert choose_spares({0: 0}, spares) == {0: "s0.0"}
    # Two dead ranks on node 1, one spare there: the other comes from node 0.
    assert choose_spares({2: 1, 3: 1}, spares) == {2: "s1.0", 3: "s0.0"}
    assert choose_spares({2: 1, 3: 1}, [("s1.0", 1)]) is None
    assert choose_spares({}, []) == {}


def test_spares_from_the_richest_node_when_the_own_node_has_none():
    spares = [("s0.0", 0), ("s2.0", 2), ("s2.1", 2)]
    assert choose_spares({5: 1}, spares) == {5: "s2.0"}


def test_a_rank_with_a_spare_on_its_own_node_is_served_before_one_taking_a_spare_from_elsewhere():
    # Rank 0 (node 1, no spare there) must not take node 0's only spare from rank 1 (node 0).
    spares = [("s0.0", 0), ("s2.0", 2)]
    assert choose_spares({0: 1, 1: 0}, spares) == {0: "s2.0", 1: "s0.0"}


def test_on_an_accelerator_a_spare_takes_only_a_rank_of_its_own_node():
    """A spare that said ``ready/<wid> = local`` (an accelerator: it takes the dead rank's device,
    and every device of another node belongs to a live rank) is never sent to another node."""
    spares = [("s0.0", 0), ("s1.0", 1)]
    local = {"s0.0", "s1.0"}
    assert choose_spares({3: 1}, spares, local) == {3: "s1.0"}
    assert choose_spares({2: 1, 3: 1}, spares, local) is None  # node 0's spare cannot go
    assert choose_spares({2: 1, 3: 1}, spares, {"s1.0"}) == {2: "s1.0", 3: "s0.0"}


def test_a_slow_nodes_spares_are_taken_last_and_its_ranks_go_elsewhere_first():
    """Issue 30: a straggler's node may be the slow part. Its rank takes another node's spare
    first, and every rank takes that node's spares last; avoiding never costs a rank its spare."""
    spares = [("s0.0", 0), ("s1.0", 1)]
    assert choose_spares({3: 1}, spares, avoid={1}) == {3: "s0.0"}
    assert choose_spares({3: 1}, spares, {"s0.0"}, avoid={1}) == {3: "s1.0"}  # node 0's may not go: its own
    assert choose_spares({0: 0}, [("s1.0", 1)], avoid={1}) == {0: "s1.0"}  # the only one left
    # A node with no spare of its own: the richest node's, unless it is avoided.
    assert choose_spares({4: 2}, [("s0.0", 0), ("s1.0", 1), ("s1.1", 1)], avoid={1}) == {4: "s0.0"}
    # The rank of the avoided node yields the spare another rank can take only.
    assert choose_spares({2: 1, 4: 2}, [("s0.0", 0), ("s1.0", 1)], {"s1.0"}, avoid={1}) == {2: "s1.0", 4: "s0.0"}
    assert choose_spares({2: 1, 3: 1}, spares, avoid={1}) == {2: "s0.0", 3: "s1.0"}


def test_plan_round_trips_and_finds_ranks():
    plan = Plan(3, 4, {"0": "a0", "1": "s1.0", "2": "a2", "3": "a3"}, replaced={"1": "s1.0"})
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.rank_of("s1.0") == 1 and again.rank_of("a1") is None


def ring(world, own, held_version):
    """Each rank r holds its own versions and rank (r-1)'s mirror at held_version[r-1]."""
    return [Holdings(own=frozenset(own[r]), held={(r - 1) % world: held_version[(r - 1) % world]})
            for r in range(world)]


def test_lands_on_the_newest_version_everyone_has():
    # All survivors hold 6 and 7; the dead rank 2's mirror (held by 3) is at 7.
    h = ring(4, [{6, 7}] * 4, [7, 7, 7, 7])
    h[2] = Holdings()  # the spare that took rank 2
    plan = choose_version(h, new_ranks=[2])
    assert plan.version == 7
    assert plan.sources == {0: (SELF,), 1: (SELF,), 2: (3,), 3: (SELF,)}


def test_survivors_ahead_roll_back_to_the_dead_ranks_committed_version():
    # Survivors finished step 8 (hold 7 and 8), but rank 1's copy of 8 never committed.
    h = ring(4, [{7, 8}] * 4, [8, 7, 8, 8])
    h[1] = Holdings()
    plan = choose_version(h, new_ranks=[1])
    assert plan.version == 7 and plan.sources[1] == (2,)


def test_a_rank_without_its_own_copy_is_fed_by_a_holder():
    h = ring(3, [{4, 5}, {4}, {4, 5}], [5, 5, 5])
    plan = choose_version(h)
    assert plan.version == 5 and plan.sources[1] == (2,) and plan.sources[0] == (SELF,)


def test_several_holders_are_all_offered():
    h = [Holdings(own=frozenset({3})), Holdings(held={0: 3}), Holdings(held={0: 3})]
    h[1] = Holdings(own=frozenset({3}), held={0: 3})
    h[2] = Holdings(own=frozenset({3}), held={0: 3})
    assert choose_version(h, new_ranks=[0]).sources[0] == (1, 2)


def test_losing_a_rank_and_its_holder_is_reported():
    h = ring(4, [{6, 7}] * 4, [7, 7, 7, 7])
    h[2] = h[3] = Holdings()
    with pytest.raises(NoConsistentVersion, match=r"every copy of rank\(s\) 2 is lost.*lost ranks this generation: \[2, 3\]"):
        choose_version(h, new_ranks=[2, 3])
    # Every rank has some version, but no one version is held for all of them.
    split = [Holdings(own=frozenset({5}), held={1: 4}), Holdings(own=frozenset({4}), held={0: 6})]
    with pytest.raises(NoConsistentVersion, match=r"newest version held anywhere \(6\).*no older version"):
        choose_version(split, new_ranks=[])
    with pytest.raises(NoConsistentVersion, match="no rank holds any version"):
        choose_version([Holdings(), Holdings()], new_ranks=[0])


def test_a_new_rank_never_restores_from_its_own_stale_report():
    # A spare has no 'own' state even if it reported some: it is new in this generation.
    h = [Holdings(own=frozenset({9}), held={1: 4}), Holdings(own=frozenset({4}), held={0: 4})]
    assert choose_version(h, new_ranks=[0]) .version == 4


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 1000, 1 << 20, 12345677])
@pytest.mark.parametrize("rates", [[1.0], [1.0, 1.0], [3.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0], [1e9, 1.0, 1.0]])
def test_split_tiles_the_buffer_on_aligned_boundaries(nbytes, rates):
    holders = list(range(10, 10 + len(rates)))
    parts = split_load(nbytes, holders, rates)
    assert sum(length for _, _, length in parts) == nbytes
    offset = 0
    for h, off, length in parts:
        assert h in holders and off == offset and length > 0
        assert off % 64 == 0
        offset += length
    assert [h for h, _, _ in parts] == sorted(h for h, _, _ in parts)


def test_split_follows_the_rates():
    parts = split_load(64 * 1000, [1, 2], [3.0, 1.0])
    assert [(h, n) for h, _, n in parts] == [(1, 64 * 750), (2, 64 * 250)]
    # An unknown rate counts as the mean of the known ones.
    parts = split_load(64 * 900, [1, 2, 3], [1.0, 0.0, 2.0])
    assert [n for _, _, n in parts] == [64 * 200, 64 * 300, 64 * 400]


def test_split_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one holder"):
        split_load(10, [], [])
    with pytest.raises(ValueError, match="2 holders but 1 rates"):
        split_load(10, [1, 2], [1.0])


def test_two_dead_ranks_with_copies_at_different_versions_land_on_the_older():
    """Rank 0's copy committed version 2 before it died, rank 1's only version 1 (its round of 2
    was cut): the holder of rank 0 still has version 1 too, so the plan lands on 1."""
    h = [Holdings(), Holdings(), Holdings(own=frozenset({1, 2}), held={0: frozenset({1, 2})}),
         Holdings(own=frozenset({1, 2}), held={1: 1})]
    plan = choose_version(h, new_ranks=[0, 1])
    assert plan.version == 1 and plan.sources == {0: (2,), 1: (3,), 2: (SELF,), 3: (SELF,)}
    # Without the older copy there is no common version.
    h[2] = Holdings(own=frozenset({1, 2}), held={0: 2})
    with pytest.raises(NoConsistentVersion):
        choose_version(h, new_ranks=[0, 1])


def test_a_spare_on_the_dead_ranks_node_takes_the_keepers_copy_first():
    # Rank 2's keeper holds 6 and 7; its peer copy is at 7 too: the keeper (local) wins.
    h = ring(4, [{6, 7}] * 4, [7, 7, 7, 7])
    h[2] = Holdings(retained=frozenset({6, 7}))
    plan = choose_version(h, new_ranks=[2])
    assert plan.version == 7 and plan.sources[2] == (KEEPER,)
    # The keeper has only the version before (the trainer died inside its update of 7): the
    # peers' copy of 7 is newer and complete, so it is used.
    h[2] = Holdings(retained=frozenset({6}))
    plan = choose_version(h, new_ranks=[2])
    assert plan.version == 7 and plan.sources[2] == (3,)


def test_the_keeper_alone_can_cover_a_rank_whose_holder_died_too():
    # Ranks 2 and 3 die together; 3 held 2's only mirror. 2's keeper covers it, 3 comes from
    # its own holder (rank 0); without the keeper rank 2 would be lost.
    h = ring(4, [{6, 7}] * 4, [7, 7, 7, 7])
    h[2], h[3] = Holdings(retained=frozenset({6, 7})), Holdings()
    plan = choose_version(h, new_ranks=[2, 3])
    assert plan.version == 7 and plan.sources[2] == (KEEPER,) and plan.sources[3] == (0,)
    h[2] = Holdings()
    with pytest.raises(NoConsistentVersion, match=r"every copy of rank\(s\) 2 is lost"):
        choose_version(h, new_ranks=[2, 3])
