"""megatron-core's pipeline path on CPU through the shim (patches/megatron_core_cpu.py): PP=2 x
DP=2 on 4 gloo ranks under hotspare-run, 1F1B with 4 microbatches, DDP and the distributed
optimizer. Two runs with the same seed are bitwise identical (losses, fp32 shards, Adam
moments), also when one of them restores every rank's unique state from a snapshot and
replays an iteration, and the loss falls. This is the base the Megatron recovery path stands on."""
from __future__ import annotations

import glob
import json
import os

import pytest

from hotspare import launch
from hotspare.testing import statedigest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "megatron_pp.py")
ITERS = 6


def run(out, roundtrip=-1):
    out.mkdir(parents=True)
    code = launch.run(launch.LaunchSpec(script=[WORKER, str(out), str(ITERS), str(roundtrip)], nproc_per_node=4,
                                        logical_nodes=2,
                                        keeper=False, extra_env={"OMP_NUM_THREADS": "1"}))
    assert code == 0
    return {r["rank"]: r for r in (json.load(open(p, encoding="utf-8")) for p in glob.glob(str(out / "rank*.json")))}


@pytest.mark.slow  # about a minute on 2 cores; the shim's behaviours are pinned in make test (test_megatron_shim.py)
def test_pipeline_parallel_training_on_cpu_is_bitwise_reproducible_and_survives_a_state_round_trip(tmp_path,
                                                                                                   no_leaks):
    """The second run snapshots every rank's unique state (MegatronState) after iteration 2,
    runs iteration 3, wrecks shards, moments and Adam's step counts, scheduler and RNG, restores the
    snapshot and runs iteration 3 again: the run still ends bitwise identical to the first."""
    first, second = run(tmp_path / "a"), run(tmp_path / "b", roundtrip=2)
    assert sorted(first) == [0, 1, 2, 3]
    assert {(r["pp"], r["dp"]) for r in first.values()} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for rank in first:
        a, b = first[rank], second[rank]
        assert (a["losses"], a["sched_steps"]) == (b["losses"], b["sched_steps"]), rank
        assert statedigest.differences(a["state"], b["state"]) == [], rank
    last = [r for r in first.values() if r["pp"] == 1]
    assert all(len(r["losses"]) == ITERS for r in last)  # each data-parallel rank's own microbatches
    losses = [sum(float.fromhex(r["losses"][str(i)]) for r in last) for i in range(ITERS)]
    assert losses[-1] < losses[0]
    redirected = {key.split(":")[0] for key in first[0]["redirects"]}
    assert "megatron/core/pipeline_parallel/p2p_communication.py" in redirected, redirected
