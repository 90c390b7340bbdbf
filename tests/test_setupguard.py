"""hotspare.setupguard (in process, a one-rank gloo group on 127.0.0.1): on a spare between
initialize and its loop, a barrier of the script's set-up is skipped, any other collective
fails at once naming the call (and is reported), other threads are not affected, and stopping
restores torch's functions."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from hotspare.setupguard import SetupGuard, SpareSetupError


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_guard_skips_barriers_and_refuses_other_collectives(one_rank):
    original_barrier, original_all_reduce = dist.barrier, dist.all_reduce
    reports = []
    guard = SetupGuard(reports.append).start()
    try:
        assert dist.barrier() is None and guard.skipped_barriers == 1
        seen = []
        other = threading.Thread(target=lambda: seen.append(dist.all_reduce(torch.ones(1))))
        other.start()
        other.join(timeout=30)
        assert seen == [None] and not reports  # the mirror's thread goes through
        with pytest.raises(SpareSetupError, match=r"torch\.distributed\.all_reduce\(\) after initialize"):
            dist.all_reduce(torch.ones(1))
        assert len(reports) == 1 and "all_reduce" in reports[0]
        assert not guard.active and dist.all_reduce is original_all_reduce  # the error lifted it
    finally:
        guard.stop()
    assert dist.barrier is original_barrier and dist.all_reduce is original_all_reduce
