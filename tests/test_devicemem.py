"""The keeper's GPU tier where no GPU is needed to check it: the torch internals it stands on,
the device sum, the device record in a retained segment, and which version a dead rank's
device copy may be restored from (hotspare.keeper_client.check_device). The copy itself is exercised
on a GPU by recipes/gpu_check.py (section keeper_device)."""
from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
import torch

from hotspare import devicemem
from hotspare.config import ConfigError, HotspareConfig, from_mapping
from hotspare.keeper_client import check_device
from hotspare.retain import EMPTY, RetainedSegment, RetainedSnapshots
from hotspare.startup import keeper_for
from hotspare.snapshot import Layout


def test_torch_cuda_ipc_reductions_keep_the_argument_order_devicemem_relies_on():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    assert list(inspect.signature(rebuild_cuda_tensor).parameters) == [
        "tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls", "dtype", "storage_device",
        "storage_handle", "storage_size_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle",
        "ref_counter_offset", "event_handle", "event_sync_required"]
    assert "rebuild_cuda_tensor," in inspect.getsource(reduce_tensor)
    with pytest.raises(ValueError, match="only CUDA memory"):
        devicemem.export(torch.zeros(8, dtype=torch.uint8))


def test_the_device_sum_is_the_exact_sum_of_the_32_bit_words():
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    want = int(np.frombuffer(buf.numpy().tobytes(), dtype=np.int32).astype(np.int64).sum())
    assert int(devicemem.device_sum(buf)) == want
    changed = buf.clone()
    changed[100] ^= 1
    assert int(devicemem.device_sum(changed)) != want
    assert int(devicemem.device_sum(buf[:4095])) == int(buf[:4095].to(torch.int64).sum())  # odd length: bytes


def _layout_and_state(n: int = 700):
    named = [("w", torch.randn(n)), ("m", torch.randn(n)), ("rng.cpu", torch.zeros(16, dtype=torch.uint8))]
    return Layout.of(named), named


def _sealed(tmp_path, version: int):
    """A segment whose slot 0 holds ``version`` and a 'device' copy (host memory stands in for the
    GPU: the check reads it through the same tensor operations) sealed at ``version``."""
    layout, named = _layout_and_state()
    seg = RetainedSegment.create(str(tmp_path / "seg"), 0, layout.id, layout.nbytes, 256)
    device = torch.zeros(layout.nbytes, dtype=torch.uint8)
    snaps = RetainedSnapshots(seg, layout, device=device)
    snaps.begin(0)
    snaps.device_begin()
    for view, dview, (_, t) in zip(layout.views(snaps.buffers[0]), layout.views(device), named):
        view.copy_(t)
        dview.copy_(t)
    snaps.device_written(0, devicemem.device_sum(device[layout.tensors_offset:]))
    snaps.seal(0, version, 1)
    seg.commit(0, version)
    return seg, layout, device, snaps


def test_a_sealed_device_copy_beside_its_host_version_is_usable(tmp_path):
    seg, layout, device, _ = _sealed(tmp_path, 5)
    assert seg.device_record()[0] == 5
    again = RetainedSegment.attach(seg.path)  # the spare's view
    version, detail = check_device(again, layout, device, again.verified_versions())
    assert version == 5 and detail["usable"]
    again.close()
    seg.close()


def test_a_device_copy_is_not_used_when_changed_unsealed_or_without_its_host_version(tmp_path):
    seg, layout, device, snaps = _sealed(tmp_path, 5)
    device[layout.tensors_offset + 3] ^= 0x10  # overwritten after its seal
    assert check_device(seg, layout, device, seg.verified_versions()) == (
        -1, {"version": 5, "usable": False, "why": "its device sum does not match its record"})
    device[layout.tensors_offset + 3] ^= 0x10
    assert check_device(seg, layout, device, {})[1]["why"] == "no good host copy of that version beside it"
    snaps.device_begin()  # the next capture's device copy was issued, its writer died before the seal
    assert seg.device_record()[0] == EMPTY
    assert check_device(seg, layout, device, seg.verified_versions())[0] == -1
    seg.close()


def test_a_new_segment_has_no_device_version(tmp_path):
    layout, _ = _layout_and_state()
    seg = RetainedSegment.create(str(tmp_path / "s"), 0, layout.id, layout.nbytes, 256)
    assert seg.device_record()[0] == EMPTY
    seg.close()


def test_the_device_tier_is_refused_without_a_keeper_or_without_cuda():
    with pytest.raises(ConfigError, match="retain.device_tier=true needs retain.keeper=true"):
        from_mapping(HotspareConfig, {"retain": {"device_tier": True, "keeper": False}})
    cfg = from_mapping(HotspareConfig, {"retain": {"device_tier": True}})
    with pytest.raises(ConfigError, match="device_tier=true needs CUDA GPUs, and the accelerator here is 'cpu'"):
        keeper_for(cfg, "cpu")


def test_the_cuda_drivers_ipc_files_of_a_process_are_found_by_its_pid(tmp_path):
    from hotspare.keeper import remove_cuda_ipc_files

    for name in ("cuda.shm.0.1e3.1", "cuda.shm.0.1e3.2", "cuda.shm.0.20e.1", "cuda.shm.0.1e3", "hotspare-x-k483-r0-1"):
        (tmp_path / name).write_bytes(b"")
    assert sorted(remove_cuda_ipc_files(0x1e3, str(tmp_path))) == ["cuda.shm.0.1e3.1", "cuda.shm.0.1e3.2"]
    assert sorted(os.listdir(tmp_path)) == ["cuda.shm.0.1e3", "cuda.shm.0.20e.1", "hotspare-x-k483-r0-1"]
