"""Retained segments and their chunk-level transactions (hotspare.retain), the keeper's request
handling and budget (hotspare.keeper.Keeper, in-process), and one contract test run against
both places a mirror's own snapshots can live. Fast: one process, files in a temp dir."""
from __future__ import annotations

import os

import pytest
import torch

from hotspare import faults
from hotspare.keeper import Keeper, remove_stale
from hotspare.mirror import Mirror
from hotspare.slots import PrivateSnapshots
from hotspare.retain import EMPTY, RetainedSegment, RetainedSnapshots, SegmentError, segment_size
from hotspare.snapshot import Layout
from hotspare.transport import Transport

CHUNK = 256


def layout_and_state(seed: int, n: int = 700):
    g = torch.Generator().manual_seed(seed)
    named = [("w", torch.randn(n, generator=g)), ("m", torch.randn(n // 2, generator=g)),
             ("step", torch.tensor([seed], dtype=torch.int64))]
    return Layout.of(named), named


def write(seg: RetainedSegment, slot: int, layout: Layout, named, version: int, generation: int = 0):
    seg.begin(slot)
    for view, (_, t) in zip(layout.views(seg.slots[slot]), named):
        view.copy_(t.reshape(-1))
    seg.seal(slot, version, generation)
    seg.commit(slot, version)


@pytest.fixture
def segment(tmp_path):
    layout, _ = layout_and_state(0)
    seg = RetainedSegment.create(str(tmp_path / "seg"), 3, layout.id, layout.nbytes, CHUNK)
    yield seg, layout
    seg.close()


def test_a_new_segment_holds_no_version_and_commits_make_one(segment, tmp_path):
    seg, layout = segment
    assert seg.complete_versions() == {} and seg.versions_by_slot() == [EMPTY, EMPTY]
    assert seg.num_chunks == -(-layout.nbytes // CHUNK) > 3
    _, named = layout_and_state(5)
    write(seg, 0, layout, named, version=5)
    again = RetainedSegment.attach(seg.path)  # what a spare on this node sees
    assert again.rank == 3 and again.layout_id == layout.id
    assert again.complete_versions() == {5: 0} and again.verified_versions() == {5: 0}
    assert torch.equal(again.slots[0], seg.slots[0])
    again.close()


@pytest.mark.parametrize("point,at", [("snapshot", None), ("keeper_seal", 0), ("keeper_seal", 2)])
def test_an_update_cut_before_its_seal_leaves_the_version_before_intact(segment, point, at):
    """Killed while the bytes are written, before the first seal record, or between two: the
    slot being written never counts, the other slot still holds the previous version."""
    seg, layout = segment
    write(seg, 0, layout, layout_and_state(1)[1], version=1)
    _, named = layout_and_state(2)
    seg.begin(1)
    views = layout.views(seg.slots[1])
    if point == "snapshot":
        views[0].copy_(named[0][1])  # half the bytes written, then the process dies
    else:
        for view, (_, t) in zip(views, named):
            view.copy_(t.reshape(-1))
        faults.arm(point, at=at, action="raise")
        with pytest.raises(RuntimeError, match="injected fault"):
            seg.seal(1, 2, 0)
        assert (seg.records[1, :at, 0] == 2).all() and (seg.records[1, at:, 0] == EMPTY).all()
    assert seg.complete_versions() == {1: 0} and seg.verified_versions() == {1: 0}
    assert seg.versions_by_slot() == [1, EMPTY]


@pytest.mark.parametrize("at", [0, 2])
def test_an_update_cut_between_its_seal_and_its_checksums_leaves_the_new_version(segment, at):
    """Sealed, then killed before (or between) the checksum records: the new version counts, its
    chunks without a checksum are reported unverified, a corrupted checksummed one still fails."""
    seg, layout = segment
    write(seg, 0, layout, layout_and_state(1)[1], version=1)
    _, named = layout_and_state(2)
    seg.begin(1)
    for view, (_, t) in zip(layout.views(seg.slots[1]), named):
        view.copy_(t.reshape(-1))
    seg.seal(1, 2, 0)
    faults.arm("keeper_commit", at=at, action="raise")
    with pytest.raises(RuntimeError, match="injected fault"):
        seg.commit(1, 2)
    assert seg.complete_versions() == {1: 0, 2: 1} and seg.verified_versions() == {1: 0, 2: 1}
    assert seg.unverified(1) == list(range(at, seg.num_chunks)) and seg.unverified(0) == []
    if at:
        seg.slots[1][0] ^= 0x01  # chunk 0 has its checksum: caught
        assert seg.verify(1) == [0] and seg.verified_versions() == {1: 0}


def test_checksums_given_by_the_round_are_the_chunks_crcs(segment):
    """The mirror hands commit the chunk CRCs from its own pass (hotspare.checksum); they must be
    what verify computes, and a wrong count is refused."""
    from hotspare import checksum

    seg, layout = segment
    _, named = layout_and_state(3)
    seg.begin(0)
    for view, (_, t) in zip(layout.views(seg.slots[0]), named):
        view.copy_(t.reshape(-1))
    seg.seal(0, 3, 0)
    buf = seg.slots[0].numpy()
    pieces = checksum.Pieces(buf, checksum.cuts(buf.size, CHUNK, 1000))
    with pytest.raises(ValueError, match="chunk checksums"):
        seg.commit(0, 3, [0])
    seg.commit(0, 3, pieces.grid(CHUNK))
    assert seg.unverified(0) == [] and seg.verify(0) == [] and seg.verified_versions() == {3: 0}


def test_overwriting_a_slot_forgets_its_old_version_before_the_first_byte(segment):
    seg, layout = segment
    write(seg, 0, layout, layout_and_state(1)[1], version=1)
    write(seg, 1, layout, layout_and_state(2)[1], version=2)
    assert seg.complete_versions() == {1: 0, 2: 1}
    seg.begin(0)
    assert seg.complete_versions() == {2: 1}


def test_a_corrupted_chunk_is_caught_by_its_checksum(segment):
    seg, layout = segment
    write(seg, 0, layout, layout_and_state(1)[1], version=1)
    write(seg, 1, layout, layout_and_state(2)[1], version=2)
    seg.slots[1][CHUNK * 2 + 7] ^= 0x01
    assert seg.verify(1) == [2] and seg.verify(0) == []
    assert seg.complete_versions() == {1: 0, 2: 1}
    assert seg.verified_versions() == {1: 0}


def test_a_file_that_is_not_a_segment_is_refused(tmp_path):
    path = tmp_path / "junk"
    path.write_bytes(b"x" * 8192)
    with pytest.raises(SegmentError, match="not a hotspare retained segment"):
        RetainedSegment.attach(str(path))
    with pytest.raises(SegmentError, match="does not exist"):
        RetainedSegment.attach(str(tmp_path / "missing"))


def test_frozen_segments_write_no_more_commit_records(segment):
    seg, layout = segment
    write(seg, 0, layout, layout_and_state(1)[1], version=1)
    write(seg, 1, layout, layout_and_state(2)[1], version=2)
    seg.begin(1)
    seg.seal(1, 3, 0)
    seg.freeze()
    seg.commit(1, 3)
    assert seg.complete_versions() == {1: 0, 3: 1} and seg.unverified(1) == list(range(seg.num_chunks))


# ---- one contract over both places a mirror's own snapshots live ----------------------------------


class NoPeers(Transport):
    def send(self, tensor, dst, tag):
        raise AssertionError("no peers")

    def recv(self, tensor, src, tag):
        raise AssertionError("no peers")

    def close(self):
        pass


def _retained(tmp_path):
    def make(layout):
        return RetainedSnapshots(RetainedSegment.create(str(tmp_path / "own"), 0, layout.id, layout.nbytes, CHUNK),
                                 layout)
    return make


@pytest.mark.parametrize("kind", ["private", "retained"])
def test_a_mirror_keeps_its_last_two_versions_in_either_kind_of_snapshots(kind, tmp_path):
    make = (lambda layout: PrivateSnapshots(layout)) if kind == "private" else _retained(tmp_path)
    mirror = Mirror(0, 0, {0: []}, NoPeers(), lambda t: None, snapshots=make)
    try:
        states = {}
        for version in (1, 2, 3):
            _, named = layout_and_state(version)
            states[version] = named
            mirror.on_step(version, lambda: named, lambda: {"v": version})
            mirror.flush(5.0)
        own, _ = mirror.holdings()
        assert own == {2, 3}
        for version in (2, 3):
            buf = mirror.own_snapshot(version)
            views = mirror.layout.views(buf)
            assert all(torch.equal(v, t.reshape(-1)) for v, (_, t) in zip(views, states[version]))
        if kind == "retained":
            seg = mirror.snapshots.segment
            assert set(seg.verified_versions()) == {2, 3} and mirror.snapshots.retained
    finally:
        mirror.close()


@pytest.mark.parametrize("kind", ["private", "retained"])
def test_the_next_generations_mirror_inherits_the_buffers_and_the_version_landed_on(kind, tmp_path):
    """After a failure the survivor's new mirror takes the old one's buffers (no allocation, no
    keeper request): the snapshot of the version landed on stays, the other buffer is free (a
    retained one's records are emptied), and the new generation's updates commit again."""
    make = (lambda layout: PrivateSnapshots(layout)) if kind == "private" else _retained(tmp_path)
    old = Mirror(0, 0, {0: []}, NoPeers(), lambda t: None, snapshots=make)
    for version in (1, 2):
        _, named = layout_and_state(version)
        old.on_step(version, lambda: named, lambda: {"v": version})
        old.flush(5.0)
    old.stop(join_s=5.0)
    buffers = list(old.snapshots.buffers)
    kept = old.own_snapshot(1).clone()
    inherited = old.hand_over(keep=1)
    assert inherited.versions.count(1) == 1 and inherited.versions.count(-1) == 1
    assert old.hand_over(keep=1) is None  # given once
    if kind == "retained":
        assert inherited.snapshots.segment.complete_versions() == {1: inherited.versions.index(1)}

    def no_allocation(layout):
        raise AssertionError("the inherited buffers must be used")

    new = Mirror(0, 1, {0: []}, NoPeers(), lambda t: None, snapshots=no_allocation, inherit=inherited)
    try:
        assert new.holdings()[0] == {1} and torch.equal(new.own_snapshot(1), kept)
        _, named = layout_and_state(3)
        new.on_step(3, lambda: named, lambda: {"v": 3})  # writes the free buffer, not version 1's
        new.flush(5.0)
        assert new.holdings()[0] == {1, 3} and all(a is b for a, b in zip(new.snapshots.buffers, buffers))
        if kind == "retained":
            seg = new.snapshots.segment
            assert set(seg.verified_versions()) == {1, 3} and seg.unverified(seg.complete_versions()[3]) == []
    finally:
        new.close()
        old.close()


def test_a_mirror_on_a_reattached_segment_knows_what_it_holds(tmp_path):
    """A survivor's next generation, or a spare, opens the same segment: its versions count."""
    make = _retained(tmp_path)
    layout, named = layout_and_state(4)
    snaps = make(layout)
    write(snaps.segment, 1, layout, named, version=4)
    again = RetainedSnapshots(RetainedSegment.attach(snaps.segment.path), layout)
    assert again.versions() == [EMPTY, 4]
    other, _ = layout_and_state(4, n=900)
    with pytest.raises(SegmentError, match="holds layout"):
        RetainedSnapshots(RetainedSegment.attach(snaps.segment.path), other)
    again.close()
    snaps.close()


# ---- the keeper's requests, budget and stale segments ---------------------------------------------


def test_the_keeper_creates_reuses_and_replaces_segments(tmp_path):
    k = Keeper("job-1", 0, str(tmp_path / "k.sock"), shm_dir=str(tmp_path))
    a = k.handle({"op": "open", "rank": 2, "layout_id": 7, "nbytes": 5000, "chunk_bytes": CHUNK})
    assert a["ok"] and not a["reused"] and a["held"]["num_slots"] == 2
    assert os.path.basename(a["held"]["path"]).startswith(f"hotspare-job_1-k{os.getpid()}-r2-")
    b = k.handle({"op": "open", "rank": 2, "layout_id": 7, "nbytes": 5000, "chunk_bytes": CHUNK})
    assert b["reused"] and b["held"]["path"] == a["held"]["path"]
    assert k.handle({"op": "lookup", "rank": 2})["held"]["path"] == a["held"]["path"]
    assert k.handle({"op": "lookup", "rank": 1})["held"] is None
    c = k.handle({"op": "open", "rank": 2, "layout_id": 8, "nbytes": 5000, "chunk_bytes": CHUNK})
    assert not c["reused"] and not os.path.exists(a["held"]["path"]) and os.path.exists(c["held"]["path"])
    assert not k.handle({"op": "nope"})["ok"]


def test_the_budget_gives_up_the_older_version_first_then_the_rank(tmp_path):
    k = Keeper("j", 0, str(tmp_path / "k.sock"), shm_dir=str(tmp_path))
    nbytes = 64 * 1024
    two, one = segment_size(nbytes, CHUNK, 2), segment_size(nbytes, CHUNK, 1)
    budget = two + one + one // 2
    r0 = k.handle({"op": "open", "rank": 0, "layout_id": 1, "nbytes": nbytes, "chunk_bytes": CHUNK,
                   "budget_bytes": budget})
    assert r0["held"]["num_slots"] == 2 and r0["note"] == ""
    r1 = k.handle({"op": "open", "rank": 1, "layout_id": 1, "nbytes": nbytes, "chunk_bytes": CHUNK,
                   "budget_bytes": budget})
    assert r1["held"]["num_slots"] == 1 and "keeps only its newest version" in r1["note"]
    r2 = k.handle({"op": "open", "rank": 2, "layout_id": 1, "nbytes": nbytes, "chunk_bytes": CHUNK,
                   "budget_bytes": budget})
    assert r2["held"] is None and "not retained on this node" in r2["note"] and "budget_mb" in r2["note"]


def test_too_little_shared_memory_is_refused_with_the_fix(tmp_path, monkeypatch):
    k = Keeper("j", 3, str(tmp_path / "k.sock"), shm_dir=str(tmp_path))

    class Tiny:
        f_bavail, f_frsize = 16, 4096

    monkeypatch.setattr(os, "statvfs", lambda _path: Tiny())
    reply = k.handle({"op": "open", "rank": 0, "layout_id": 1, "nbytes": 1 << 20, "chunk_bytes": CHUNK})
    assert not reply["ok"] and "--shm-size" in reply["error"] and "node 3" in reply["error"]
    assert os.listdir(tmp_path) == []


def test_stale_segments_of_a_gone_keeper_are_removed(tmp_path):
    dead_pid = 2**22 + 12345  # above any pid_max default: no such process
    stale = tmp_path / f"hotspare-old-k{dead_pid}-r0-1"
    stale.write_bytes(b"")
    # A live process that is not a keeper (its pid was reused): its names count as stale too.
    reused = tmp_path / f"hotspare-now-k{os.getpid()}-r0-1"
    reused.write_bytes(b"")
    other = tmp_path / "not-ours"
    other.write_bytes(b"")
    assert sorted(remove_stale(str(tmp_path))) == sorted([stale.name, reused.name])
    assert os.listdir(tmp_path) == [other.name]
