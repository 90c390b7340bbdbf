"""A rank's own snapshots: each step the state is captured into one of two buffers (the other
keeps the version before, or the globally committed one), in the rank's memory or its keeper's
(:mod:`hotspare.slots`), and, with ``retain.device_tier``, into the keeper's device copy too.

On an accelerator the capture is asynchronous: the device-to-host copies run on a stream of
their own into pinned buffers, the training thread goes on at once, the mirror thread waits for
the copy's event before it seals, checksums and sends (:meth:`Capture.seal_landed`), and the
next optimizer step waits for it on the device (:meth:`Capture.before_update`). On the CPU the
copy is synchronous and sealed on the training thread (see :mod:`hotspare.retain`: a trainer
killed after its step leaves that version behind).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from . import accelerator, faults
from .devicemem import device_sum
from .slots import NO_VERSION, Snapshots
from .snapshot import Layout, write_meta


class Capture:
    """The two snapshot buffers of one rank and the copy of its state into them."""

    def __init__(self, generation: int, pin_memory: bool, make_snapshots: Callable[[Layout], Snapshots],
                 on_event: Callable[..., None]):
        self.generation = generation
        self._make_snapshots, self.on_event = make_snapshots, on_event
        self.layout: Layout | None = None
        self.snapshots: Snapshots | None = None
        self.buffers: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] = []
        self.versions = [NO_VERSION, NO_VERSION]
        """The version each buffer holds (NO_VERSION: none, or being overwritten)."""
        self._acc = self._stream = None
        self._copied: list = [None, None]  # per slot: the event of its copy in flight
        self._fence = None  # the newest copy's event: sources must not change before it
        self._device_views: list[torch.Tensor] | None = None  # typed views of snapshots.device
        if pin_memory:
            acc = accelerator.get()
            if acc.Stream is not None:  # no streams (a CPU accelerator): the capture stays synchronous
                self._acc, self._stream = acc, acc.Stream()

    def adopt(self, layout: Layout, snapshots: Snapshots, versions: list[int]) -> None:
        """Capture into ``snapshots`` (laid out as ``layout``) from now on; ``versions``: what they hold."""
        self.layout, self.snapshots, self._device_views = layout, snapshots, None
        self.buffers = snapshots.buffers
        self._views = [layout.views(b) for b in self.buffers]
        self.versions = list(versions)

    def _allocate(self, named: list) -> None:
        if self.layout is not None:
            self.on_event("mirror_layout_changed", old_bytes=self.layout.nbytes)
            self.snapshots.close()
        layout = Layout.of(named)
        snapshots = self._make_snapshots(layout)
        self.adopt(layout, snapshots, snapshots.versions())

    def capture(self, version: int, named: list, meta: dict, keep: int) -> int:
        """Copy the state after ``version`` steps (``named`` tensors and ``meta``) into a buffer;
        never into the one holding ``keep`` (the globally committed version: a recovery may land
        there). Returns the buffer's slot."""
        if self.layout is None or not self.layout.matches(named):
            self._allocate(named)
        held = self.versions
        if keep != NO_VERSION and keep in held:
            slot = 1 - held.index(keep)
        else:
            slot = 0 if held[0] <= held[1] else 1
        self.versions[slot] = NO_VERSION
        self.snapshots.begin(slot)
        if self._stream is None:
            for i, (view, (_, src)) in enumerate(zip(self._views[slot], named)):
                faults.hit("snapshot_write", i)
                view.copy_(src.reshape(-1))
            write_meta(self.buffers[slot], self.layout, meta)
            self.snapshots.seal(slot, version, self.generation)  # see retain.py: sealed on the training thread
        else:
            device = self.snapshots.device
            if device is not None:
                self.snapshots.device_begin()
            self._stream.wait_stream(self._acc.current_stream())  # after the step's kernels that wrote the state
            with self._acc.stream(self._stream):
                for i, (view, (_, src)) in enumerate(zip(self._views[slot], named)):
                    faults.hit("snapshot_write", i)
                    if src.device.type != "cpu":
                        src.record_stream(self._stream)
                    view.copy_(src.reshape(-1), non_blocking=True)
                if device is not None:
                    if self._device_views is None:
                        self._device_views = self.layout.views(device)
                    for view, (_, src) in zip(self._device_views, named):
                        view.copy_(src.reshape(-1), non_blocking=True)
                    self.snapshots.device_written(slot, device_sum(device[self.layout.tensors_offset:]))
            event = self._acc.Event()
            event.record(self._stream)
            self._copied[slot] = self._fence = event
            write_meta(self.buffers[slot], self.layout, meta)  # host memory: the metadata is written now
        self.versions[slot] = version
        return slot

    def before_update(self) -> None:
        """Call before anything changes the captured state (the optimizer step): on an
        accelerator, the device waits there until the last capture's copy has read it (the
        training thread does not wait). A no-op on CPU, where the capture is synchronous."""
        if self._fence is not None:
            self._acc.current_stream().wait_event(self._fence)

    def landed(self, slot: int) -> None:
        """Block until slot's device-to-host copy is in host memory (accelerator only)."""
        event = self._copied[slot]
        if event is not None:
            event.synchronize()
            self._copied[slot] = None

    def all_landed(self) -> None:
        for slot in (0, 1):
            self.landed(slot)

    def seal_landed(self, slot: int, version: int) -> None:
        """The mirror thread, before a round: on an accelerator the copy into ``slot`` has landed,
        and it is sealed only now that its bytes are all there (on the CPU it was sealed at the capture)."""
        if self._stream is not None:
            self.landed(slot)
            self.snapshots.seal(slot, version, self.generation)

    def find(self, version: int) -> torch.Tensor | None:
        """The buffer holding ``version``, if one still does."""
        for slot in (0, 1):
            if self.versions[slot] == version:
                return self.buffers[slot]
        return None

    def hand_over(self, keep: int) -> tuple[Layout, Snapshots, list[int]]:
        """Give the buffers up for the next generation's mirror: every version of ``keep`` or older
        stays; a buffer of a later version is marked free (a retained one loses its records too)."""
        versions = [v if v <= keep else NO_VERSION for v in self.versions]
        for slot, v in enumerate(versions):
            if v == NO_VERSION:
                self.snapshots.begin(slot)
        out = (self.layout, self.snapshots, versions)
        self.layout, self.snapshots, self.buffers, self._views = None, None, [], []
        self.versions = [NO_VERSION, NO_VERSION]
        return out
