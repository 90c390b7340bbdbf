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
def test_zero_partitions_are_where_hotspare_reads_them(stage, dtype, tmp_path, no_leaks, capfd):
    out = tmp_path / "pin.json"
    code = launch.run(launch.LaunchSpec(script=[WORKER, str(stage), dtype, str(out)], nproc_per_node=2,
                                        extra_env={"OMP_NUM_THREADS": "1"}))
    assert code == 0, "a pinned DeepSpeed internal moved: see the worker's AssertionError above"
    off = 'hotspare is off (no "hotspare" section in the DeepSpeed config)'
    assert (capfd.readouterr().err.count(off) == 1) == (dtype == "bf16")  # the bf16 case has no section
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert 2 * result["partition_numel"] >= result["num_params"]


def test_the_checkpoint_engine_interface_hotspare_overrides():
    """save_checkpoint writes through engine.checkpoint_engine: create, save (one per file), then
    commit unless decoupled."""
    import inspect

    from hotspare import env

    env.configure_accelerator()
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    from hotspare.integrations.deepspeed.checkpoint_engine import engine_class

    for name in ("create", "save", "load", "commit", "makedirs", "is_decoupled", "preserves_storage_sharing",
                 "is_data_parallel_writer"):
        assert callable(getattr(CheckpointEngine, name, None)), name
    assert issubclass(engine_class(), CheckpointEngine)
    src = inspect.getsource(DeepSpeedEngine.save_checkpoint)
    order = [src.index(s) for s in ("checkpoint_engine.create(", "_save_checkpoint(", "checkpoint_engine.commit(")]
    assert order == sorted(order)
    assert "save_latest and self.global_rank == 0" in src  # save_latest=False writes no 'latest' file
    # The ZeRO partition's state goes to checkpoint_engine.save live (not cloned): the background
    # engine's save() must copy it before returning.
    assert "self.checkpoint_engine.save(" in inspect.getsource(DeepSpeedEngine._save_zero_checkpoint)
    assert "client_state" in inspect.signature(DeepSpeedEngine.save_checkpoint).parameters
