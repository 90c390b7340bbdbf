"""In-place recovery of a megatron-core pipeline: PP=2 x DP=2 on 4 active ranks plus spares over 2
logical nodes (1F1B, 4 microbatches, distributed Adam); a rank of the first stage and,
separately, one of the last stage is SIGKILLed mid-iteration. A spare takes its place, every
parallel_state group is made anew and re-pointed (no collective touches a destroyed group), and
the run ends bitwise identical (losses, fp32 shards, Adam moments, scheduler) to one that
never failed."""
from __future__ import annotations

import glob
import json
import os

import pytest

from hotspare import launch

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
WORKER = os.path.join(WORKERS, "megatron_recover.py")
ITERS = 5


def run(out, kill="none", spares=1, keeper=True):
    out.mkdir(parents=True)
    code = launch.run(launch.LaunchSpec(script=[WORKER, str(out), str(ITERS), kill], nproc_per_node=4,
                                        logical_nodes=2, spares_per_node=spares, keeper=keeper, stall_grace_s=2.0,
                                        extra_env={"OMP_NUM_THREADS": "1"}))
    results = {}
    for path in glob.glob(str(out / "*.json")):
        r = json.load(open(path, encoding="utf-8"))
        results[r["rank"]] = r
    return code, results


_REFERENCE: dict = {}


def reference(tmp_path_factory):
    if not _REFERENCE:
        code, results = run(tmp_path_factory.mktemp("mcore-ref") / "out", spares=0, keeper=False)
        assert code == 0 and sorted(results) == [0, 1, 2, 3]
        _REFERENCE.update(results)
    return _REFERENCE


# About 60 s for both (and the shared reference run) on 2 cores: in make test.
@pytest.mark.parametrize("kill,keeper", [("0:2:1:forward", True), ("3:3:2:forward", False)],
                         ids=["first-stage-keeper", "last-stage-peers"])
def test_a_pipeline_rank_killed_mid_iteration_is_replaced_in_place_bitwise(kill, keeper, tmp_path, tmp_path_factory,
                                                                          no_leaks):
    ref = reference(tmp_path_factory)
    code, got = run(tmp_path / "out", kill=kill, keeper=keeper)
    assert code == 0
    assert sorted(got) == [0, 1, 2, 3], f"ranks that finished: {sorted(got)}"
    killed = int(kill.split(":")[0])
    assert got[killed]["spare"], "the killed rank was not taken over by a spare"
    for rank in range(4):
        a, b = ref[rank], got[rank]
        assert b["iteration"] == ITERS
        assert (b["state"], b["sched_steps"]) == (a["state"], a["sched_steps"]), f"rank {rank}: final state differs"
        # A spare's losses start at the iteration it landed on; a survivor's cover the whole run.
        assert b["losses"] == {k: a["losses"][k] for k in b["losses"]}, f"rank {rank}: losses differ"
        if b["pp"] == 1:
            landed = b["recoveries"][0]["version"]
            assert set(b["losses"]) >= {str(i) for i in range(0 if not b["spare"] else landed, ITERS)}
        assert len(b["recoveries"]) == 1, b["recoveries"]
        assert b["stale_group_calls"] == 0, f"rank {rank} ran collectives on destroyed groups"
