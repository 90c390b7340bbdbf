"""hotspare.erasure: zfec stripes of a snapshot, decoding from any k of k+m shares, checksums
that keep a bad share out, and the placement of shares on distinct nodes."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from hotspare.erasure import ErasureError, decode, encode, place_shares


def snapshot(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("k, m, nbytes", [(2, 1, 10_001), (3, 2, 4096), (1, 1, 7), (4, 2, 1)])
def test_any_k_of_k_plus_m_shares_rebuild_the_snapshot_bitwise(k, m, nbytes):
    data = snapshot(nbytes)
    info, shares = encode(data, k, m)
    assert len(shares) == k + m and all(len(s) == info.block for s in shares)
    assert info.block * k >= nbytes > info.block * (k - 1) or nbytes < k
    for keep in itertools.combinations(range(k + m), k):
        assert decode(info, {i: shares[i] for i in keep}) == data, keep


def test_memory_is_k_plus_m_over_k_of_the_snapshot():
    data = snapshot(1 << 20)
    info, shares = encode(data, 4, 2)
    assert sum(len(s) for s in shares) / len(data) == pytest.approx(6 / 4, rel=1e-4)


def test_a_corrupted_share_is_dropped_and_another_used():
    data = snapshot(5000)
    info, shares = encode(data, 2, 2)
    bad = bytearray(shares[0])
    bad[17] ^= 0x01
    assert decode(info, {0: bytes(bad), 1: shares[1], 3: shares[3]}) == data
    with pytest.raises(ErasureError, match=r"0 good share\(s\), 2 needed \(missing \[1, 2, 3\], failed their "
                                           r"checksum \[0\]\)"):
        decode(info, {0: bytes(bad)})


def test_too_few_shares_say_which_are_missing():
    info, shares = encode(snapshot(100), 3, 1)
    with pytest.raises(ErasureError, match=r"missing \[0, 3\]"):
        decode(info, {1: shares[1], 2: shares[2]})


@pytest.mark.parametrize("k, m, message", [(0, 1, "k=0 must be at least 1"), (2, 0, "m=0 must be at least 1")])
def test_bad_k_and_m_are_refused(k, m, message):
    with pytest.raises(ValueError, match=message):
        encode(b"abc", k, m)


def test_shares_go_to_k_plus_m_distinct_nodes_starting_with_the_own_one():
    nodes = [0, 0, 1, 1, 2, 2, 3, 3]
    placement = place_shares(nodes, 2, 1)
    for r, holders in placement.items():
        assert holders[0] == r
        assert len({nodes[h] for h in holders}) == 3
    load = [sum(h == r for hs in placement.values() for h in hs) for r in range(len(nodes))]
    assert load == [3] * len(nodes)  # every rank holds as many shares as it owns
    assert placement[1] == [1, 3, 5]


def test_placement_needs_k_plus_m_nodes():
    with pytest.raises(ValueError, match="k\\+m=3 shares need 3 distinct nodes, the job has 2"):
        place_shares([0, 0, 1, 1], 2, 1)
