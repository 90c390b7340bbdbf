"""hotspare.accelerator: what the shared modules (the capture, snapshot buffers, keeper mappings)
use without DeepSpeed, and DeepSpeed's accelerator once its integration registers it."""
from __future__ import annotations

import torch

from hotspare import accelerator
from hotspare.capture import Capture
from hotspare.slots import PrivateSnapshots
from hotspare.snapshot import Layout


def test_without_a_registered_accelerator_torch_stands_in(monkeypatch):
    monkeypatch.setattr(accelerator, "_current", None)
    acc = accelerator.get()
    assert isinstance(acc, accelerator.TorchAccelerator) and accelerator.get() is acc
    cuda = torch.cuda.is_available()
    assert acc.device_name() == ("cuda" if cuda else "cpu")
    assert (acc.Stream is None) == (not cuda) and (acc.Event is None) == (not cuda)
    t = torch.zeros(8)
    assert acc.pin_memory(t).is_pinned() if cuda else acc.pin_memory(t) is t


def test_a_registered_accelerator_is_the_one_the_capture_uses(monkeypatch):
    calls = []

    class Fake:
        Stream = None  # a CPU accelerator: the capture stays synchronous

        def device_name(self):
            return "cpu"

        def pin_memory(self, t):
            calls.append(t.numel())
            return t

    monkeypatch.setattr(accelerator, "_current", None)
    accelerator.use(Fake())
    named = [("w", torch.arange(6, dtype=torch.float32))]
    layout = Layout.of(named)
    capture = Capture(0, True, lambda lay: PrivateSnapshots(lay, pin_memory=True), lambda *a, **k: None)
    slot = capture.capture(1, named, {"step": 1}, keep=-1)
    assert calls == [layout.nbytes, layout.nbytes]  # both buffers pinned through it
    assert torch.equal(layout.views(capture.buffers[slot])[0], named[0][1]) and capture.versions[slot] == 1
    capture.before_update()  # no stream, no fence: nothing to wait for
    assert capture.find(1) is capture.buffers[slot] and capture.find(2) is None
