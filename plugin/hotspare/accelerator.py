"""The accelerator the modules shared by both integrations use (the mirror's copy stream and
events, pinned snapshot buffers, the keeper's page-locked mappings).

The DeepSpeed integration registers DeepSpeed's own accelerator (:func:`use`), so every call
goes through its abstraction (CUDA, ROCm, XPU, HPU, CPU...). Without it (megatron-core, the
protocol tests, a benchmark of the mirror alone) :class:`TorchAccelerator` stands in with the
same few calls, from torch: CUDA where it is available, else the CPU, which has no streams
(the capture is then synchronous, as on DeepSpeed's CPU accelerator). Nothing here imports
DeepSpeed.
"""
from __future__ import annotations

import torch


class TorchAccelerator:
    """The part of DeepSpeed's accelerator interface hotspare calls, from torch alone."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()

    def device_name(self) -> str:
        return "cuda" if self._cuda else "cpu"

    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name (a class, or None without streams)
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self):  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self):
        return torch.cuda.current_stream()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor


_current = None


def use(accelerator) -> None:
    """Make ``accelerator`` (DeepSpeed's ``get_accelerator()``) the one hotspare uses."""
    global _current
    _current = accelerator


def get():
    """The registered accelerator, or torch's (:class:`TorchAccelerator`) when none is."""
    global _current
    if _current is None:
        _current = TorchAccelerator()
    return _current
