"""Pins the DeepSpeed 0.19 internals hotspare reads (ZeRO partitions, the inner optimizer's
state, the groups a rebuild re-points), so an upgrade that moves them fails here first.
Runs real ranks (2 processes, gloo, 127.0.0.1) under hotspare-run for each ZeRO stage."""
from __future__ import annotations

import json
import os

import pytest

from hotspare import launch

WORKER = os.path.join(os.path.dirname(__file__), "workers", "pin_deepspeed.py")


def test_supported_version_is_checked():
    from hotspare.integrations.deepspeed import check_version

    assert check_version().startswith("0.19.")


@pytest.mark.parametrize("stage, dtype", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16")])
def test_zero_partitions_are_where_hotspare_reads_them(stage, dtype, tmp_path, no_leaks):
    out = tmp_path / "pin.json"
    code = launch.run(launch.LaunchSpec(script=[WORKER, str(stage), dtype, str(out)], nproc_per_node=2,
                                        extra_env={"OMP_NUM_THREADS": "1"}))
    assert code == 0, "a pinned DeepSpeed internal moved: see the worker's AssertionError above"
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert 2 * result["partition_numel"] >= result["num_params"]
