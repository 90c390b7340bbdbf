"""The persistent-checkpoint tier's pieces: completion markers, pruning, the background writer.

The end-to-end fallback (a rank and its only mirror holder lost, every rank loads the newest
complete checkpoint, training finishes bitwise identical) is in tests/test_recover.py.
"""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from hotspare import checkpoint, env
from hotspare.integrations.deepspeed.checkpoint_engine import make_engine


def _tag(directory, step, ranks, world=2):
    d = directory / checkpoint.tag_of(step)
    d.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        (d / f"hotspare.rank{r}.done").write_text(json.dumps({"world_size": world}))
    return d


def test_a_tag_is_complete_only_with_every_ranks_marker(tmp_path):
    _tag(tmp_path, 2, [0, 1])
    _tag(tmp_path, 4, [0])  # rank 1 died before its files were on disk
    d = _tag(tmp_path, 6, [0, 1])
    (d / "hotspare.rank1.done").write_text('{"world_si')  # torn by a crash mid-write
    _tag(tmp_path, 8, [0, 1], world=4)  # another world size: not this job's layout
    (tmp_path / "latest").write_text("global_step8")
    assert checkpoint.complete_steps(str(tmp_path), 2) == [2]
    assert checkpoint.complete_steps(str(tmp_path / "missing"), 2) == []
    assert checkpoint.complete_steps("", 2) == []
    # One rank's own view (megatron-core's saves: each rank reads its marker, the ranks agree).
    done = {(step, r): checkpoint.rank_done(str(tmp_path), checkpoint.tag_of(step), r, 2)
            for step in (2, 4, 6, 8) for r in (0, 1)}
    assert [k for k, v in done.items() if v] == [(2, 0), (2, 1), (4, 0), (6, 0)]
    checkpoint.write_marker(str(tmp_path), checkpoint.tag_of(4), 1, 2, ["x.pt"], 10)
    assert checkpoint.complete_steps(str(tmp_path), 2) == [2, 4]


def test_prune_keeps_the_newest_complete_and_drops_older_leftovers(tmp_path):
    for step in (2, 4, 8):
        _tag(tmp_path, step, [0, 1])
    _tag(tmp_path, 3, [1])  # incomplete, older than a kept one: a crash's leftovers
    _tag(tmp_path, 10, [0])  # incomplete, newer: maybe still being written
    assert checkpoint.prune(str(tmp_path), 2, keep=2) == ["global_step2", "global_step3"]
    assert sorted(os.listdir(tmp_path)) == ["global_step10", "global_step4", "global_step8"]
    assert checkpoint.prune(str(tmp_path), 2, keep=2) == []


class _Info:
    def __init__(self, save_dir, tag):
        self.save_dir, self.tag, self.save_latest = save_dir, tag, False


@pytest.fixture
def writer():
    env.configure_accelerator()
    events = []
    engine = make_engine(rank=0, world_size=1, keep=1, on_event=lambda kind, **f: events.append((kind, f)))
    engine.events = events
    yield engine
    engine.close()


def test_the_writer_copies_at_save_and_writes_in_the_background(tmp_path, writer):
    live = torch.arange(8, dtype=torch.float32)
    for step in (1, 2):
        tag_dir = tmp_path / checkpoint.tag_of(step)
        tag_dir.mkdir()
        writer.create(_Info(str(tmp_path), checkpoint.tag_of(step)))
        writer.save({"w": live, "nested": [{"m": live * 2}], "step": step}, str(tag_dir / "state.pt"))
        live += 100  # the next step changes the live tensor before (or while) the file is written
        writer.commit(_Info(str(tmp_path), checkpoint.tag_of(step)))
    assert writer.flush(30.0)
    # keep=1: only the newest complete tag is left, and it holds the values at its save.
    assert checkpoint.complete_steps(str(tmp_path), 1) == [2]
    saved = torch.load(tmp_path / "global_step2" / "state.pt", weights_only=False)
    assert torch.equal(saved["w"], torch.arange(8, dtype=torch.float32) + 100) and saved["step"] == 2
    assert torch.equal(saved["nested"][0]["m"], (torch.arange(8, dtype=torch.float32) + 100) * 2)
    assert [k for k, _ in writer.events] == ["checkpoint_saved", "checkpoint_saved"]
    assert writer.events[-1][1]["version"] == 2 and writer.events[-1][1]["bytes"] > 0
    assert not writer.preserves_storage_sharing()
    assert [t for t in threading.enumerate() if t.name == "hotspare-checkpoint"]


def test_a_failed_write_is_reported_at_the_next_save_and_leaves_no_marker(tmp_path, writer):
    info = _Info(str(tmp_path), checkpoint.tag_of(3))
    writer.create(info)
    writer.save({"w": torch.ones(2)}, str(tmp_path / "no-such-dir" / "state.pt"))
    writer.commit(info)
    with pytest.raises(checkpoint.CheckpointWriteError, match="writing a persistent checkpoint failed"):
        writer.flush(30.0)
    assert checkpoint.complete_steps(str(tmp_path), 1) == []
    assert writer.events[-1][0] == "checkpoint_failed" and "no-such-dir" in writer.events[-1][1]["error"]
    with pytest.raises(checkpoint.CheckpointWriteError):
        writer.commit(info)
    writer.error = None  # let the fixture close it


def test_close_writes_what_is_queued_and_stops_the_thread(tmp_path):
    env.configure_accelerator()
    engine = make_engine(rank=0, world_size=1, keep=3)
    (tmp_path / "global_step1").mkdir()
    info = _Info(str(tmp_path), "global_step1")
    engine.create(info)
    engine.save({"w": torch.zeros(1 << 16)}, str(tmp_path / "global_step1" / "s.pt"))
    engine.commit(info)
    engine.close()
    assert checkpoint.complete_steps(str(tmp_path), 1) == [1]
    assert not engine.writing
