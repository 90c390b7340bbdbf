"""Device memory shared across processes: the keeper's GPU tier (``retain.device_tier``).

The keeper allocates a buffer on a rank's GPU and exports its CUDA IPC handle; the trainer on
that GPU maps it and its mirror copies each captured snapshot into it, device to device, beside
the copy to host memory. The allocation is the keeper's: when the trainer dies, the bytes stay
on the GPU, and the spare that takes the rank on the same GPU maps the same handle and restores
from it at device speed (no host-to-device copy of the state).

The handle travels as JSON (base64 fields), never pickled. It is made and opened with PyTorch's
own CUDA IPC machinery (``torch.multiprocessing.reductions``: ``reduce_tensor`` in the exporter,
``rebuild_cuda_tensor`` in the importer, the pair behind sending a CUDA tensor through a
``torch.multiprocessing`` queue), whose argument order tests/test_devicemem.py pins. The
exporter must outlive every importer's use: the keeper frees a buffer only when the rank's
segment is released or the keeper stops.

Integrity: :func:`device_sum` is the sum of the buffer's 32-bit words in 64-bit integer
arithmetic, computed on the device (integer addition is exact and order-independent, so it is
deterministic on any kernel). It catches a buffer never written or overwritten since; bit
errors are HBM ECC's. The host tier (CRC-32C per chunk) stays the reference copy.
"""
from __future__ import annotations

import base64

import torch

_B = ("handle", "ref_handle", "event_handle")


def export(buf: torch.Tensor) -> dict:
    """The IPC handle of CUDA tensor ``buf`` as a JSON-able dict (the exporting process keeps ``buf``)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buf.device.type != "cuda":
        raise ValueError(f"only CUDA memory has IPC handles, not {buf.device}")
    _rebuild, a = reduce_tensor(buf)
    e = lambda x: None if x is None else base64.b64encode(x).decode()  # noqa: E731
    return {"size": list(a[1]), "stride": list(a[2]), "offset": a[3], "dtype": str(a[5]).removeprefix("torch."),
            "device": a[6], "handle": e(a[7]), "storage_size": a[8], "storage_offset": a[9],
            "requires_grad": bool(a[10]), "ref_handle": e(a[11]), "ref_offset": a[12], "event_handle": e(a[13]),
            "event_sync": a[14]}


def attach(wire: dict) -> torch.Tensor:
    """Map the buffer ``wire`` (from :func:`export`, in another process) into this process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    b = {k: None if wire[k] is None else base64.b64decode(wire[k]) for k in _B}
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(wire["size"]), tuple(wire["stride"]), wire["offset"],
                               torch.UntypedStorage, getattr(torch, wire["dtype"]), wire["device"], b["handle"],
                               wire["storage_size"], wire["storage_offset"], wire["requires_grad"],
                               b["ref_handle"], wire["ref_offset"], b["event_handle"], wire["event_sync"])


def device_sum(buf: torch.Tensor) -> torch.Tensor:
    """The int64 sum of ``buf``'s 32-bit words (its bytes where the length is not a multiple of 4),
    as a 0-d tensor on ``buf``'s device (no synchronisation)."""
    words = buf.view(torch.int32) if buf.numel() % 4 == 0 else buf
    return words.sum(dtype=torch.int64)
