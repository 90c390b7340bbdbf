"""Retained snapshots: a rank's own snapshot buffers in a shared-memory segment, updated as
chunk-level transactions so that a trainer killed in the middle of an update leaves a
consistent version behind.

A segment (a file under /dev/shm, created and owned by the node's keeper, see
:mod:`hotspare.keeper`) holds a fixed header, a table of commit records and ``num_slots``
snapshot buffers of one :class:`~hotspare.snapshot.Layout`. Each buffer is split into chunks
of ``chunk_bytes``; every (slot, chunk) has one commit record of int64 fields
(version, crc32, generation). An update of version v into slot s:

1. :meth:`RetainedSegment.begin`: every record of slot s is marked empty (version -1), before
   the first byte of s is written;
2. the snapshot's bytes are written into s (the mirror's capture, on the training thread);
3. :meth:`RetainedSegment.seal`, on the training thread right after the capture: for each
   chunk in turn its generation and a pending checksum are written, then its version, last
   (the version is what makes the record count): a few stores per chunk, no pass over bytes;
4. :meth:`RetainedSegment.commit`, off the training thread (the mirror round): each chunk's
   CRC-32C replaces its pending mark.

A chunk is therefore empty, or holds version v with a checksum that matches its bytes or is
still pending; slot s holds version v only when every one of its chunks does. A trainer that
dies anywhere in steps 1-3 leaves s incomplete and the other slot (the version before)
intact, so :meth:`complete_versions` always names at least one consistent version once the
first update was sealed; one that dies in step 4 leaves v complete. Readers check each
chunk's CRC-32C against its record (:meth:`verify`) before the bytes are used; a chunk that
fails is never restored from.

A chunk whose checksum is still pending (:meth:`unverified`) was written in full by a writer
that died before its round checksummed it: the seal comes after the last byte. Its bytes are
as trustworthy as a surviving rank's own snapshot, which no checksum guards either, and
restoring them saves the iteration the round had not yet protected; the spare that restores
them says so (``unverified_chunks`` in its ``keeper_attach`` event). Sealing on the training
thread is what lets a trainer killed right after its step lose no iteration: the checksum
pass (about 7x a copy's cost) stays off the critical path.

Writes are plain stores into a shared mapping: they survive the writer's death (the page
cache keeps them), not the node's (tier 2, the peers' mirrors or stripes, covers that).

The keeper's GPU tier (``retain.device_tier``, :mod:`hotspare.devicemem`) keeps one more copy
of the newest capture's tensors in device memory the keeper owns. Its record lives in this
segment's header page: (version, device sum, generation), emptied before the device copy is
issued and written, version last, once the copy's event fired. It counts only beside a complete
host slot of the same version, whose metadata and RNG states the restore reads.
"""
from __future__ import annotations

import mmap
import os
import struct

import numpy as np

from . import checksum, faults
from .errors import HotspareError

SEGMENT_MAGIC = 0x48535253  # "HSRS"
FORMAT_VERSION = 2
HEADER_BYTES = 4096
# magic, format, rank, layout_id, nbytes (per slot), chunk_bytes, num_chunks, num_slots
_HEADER = struct.Struct("<8q")
DEVICE_RECORD_AT = 128  # in the header page: version, device sum, generation (int64 each)
RECORD_FIELDS = 3  # version, crc32, generation
EMPTY = -1
CRC_PENDING = -2
"""A sealed chunk's checksum before its round computed it (CRC-32C values are 0 .. 2^32-1)."""
PAGE = 4096


class SegmentError(HotspareError, RuntimeError):
    """A retained segment is missing, of another layout, or not a hotspare segment."""


def _page_align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def segment_size(nbytes: int, chunk_bytes: int, num_slots: int) -> int:
    """Bytes a segment of ``num_slots`` snapshot buffers of ``nbytes`` takes in /dev/shm."""
    num_chunks = max(1, -(-nbytes // chunk_bytes))
    records = _page_align(num_slots * num_chunks * RECORD_FIELDS * 8)
    return HEADER_BYTES + records + num_slots * _page_align(nbytes)


class RetainedSegment:
    """One rank's retained snapshot buffers, mapped into this process.

    ``create`` formats a new file (the keeper does, see :mod:`hotspare.keeper`); ``attach``
    maps an existing one (a trainer, or a spare taking the dead rank's place on its node).
    """

    def __init__(self, path: str, mm: mmap.mmap):
        self.path, self._mm = path, mm
        fields = _HEADER.unpack_from(mm, 0)
        magic, fmt, self.rank, self.layout_id, self.nbytes, self.chunk_bytes, self.num_chunks, self.num_slots = fields
        if magic != SEGMENT_MAGIC or fmt != FORMAT_VERSION:
            raise SegmentError(f"{path} is not a hotspare retained segment of format {FORMAT_VERSION} "
                               f"(magic {magic:#x}, format {fmt})")
        raw = np.frombuffer(mm, dtype=np.uint8)
        rec_bytes = self.num_slots * self.num_chunks * RECORD_FIELDS * 8
        self.records = raw[HEADER_BYTES:HEADER_BYTES + rec_bytes].view(np.int64).reshape(
            self.num_slots, self.num_chunks, RECORD_FIELDS)
        start = HEADER_BYTES + _page_align(rec_bytes)
        stride = _page_align(self.nbytes)
        self._data = [raw[start + i * stride:start + i * stride + self.nbytes] for i in range(self.num_slots)]
        self.device_rec = raw[DEVICE_RECORD_AT:DEVICE_RECORD_AT + 24].view(np.int64)
        self._slots = None
        self._stop = False

    @property
    def slots(self) -> list:
        """The snapshot buffers as uint8 tensors over the shared mapping (torch is imported only
        here: the keeper process, which never reads them, starts without it)."""
        if self._slots is None:
            import torch

            self._slots = [torch.from_numpy(d) for d in self._data]
        return self._slots

    @classmethod
    def create(cls, path: str, rank: int, layout_id: int, nbytes: int, chunk_bytes: int,
               num_slots: int = 2) -> "RetainedSegment":
        """Create and format ``path`` (every record empty). The pages are allocated now, so a full
        /dev/shm fails here with ENOSPC instead of a SIGBUS in the middle of a training step."""
        if num_slots not in (1, 2):
            raise ValueError(f"num_slots={num_slots}: a segment holds 1 or 2 snapshot buffers")
        size = segment_size(nbytes, chunk_bytes, num_slots)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        num_chunks = max(1, -(-nbytes // chunk_bytes))
        _HEADER.pack_into(mm, 0, SEGMENT_MAGIC, FORMAT_VERSION, rank, layout_id, nbytes, chunk_bytes, num_chunks,
                          num_slots)
        seg = cls(path, mm)
        seg.records[...] = EMPTY
        seg.device_rec[...] = EMPTY
        return seg

    @classmethod
    def attach(cls, path: str) -> "RetainedSegment":
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise SegmentError(f"retained segment {path} does not exist (its keeper removed it, or the node "
                               f"restarted)") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise SegmentError(f"{path} is {size} bytes: not a hotspare retained segment")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mm)

    # ---- the transaction (writer) -------------------------------------------------------------

    def begin(self, slot: int) -> None:
        """Slot ``slot`` is about to be overwritten: none of its chunks counts any more."""
        self.records[slot, :, 0] = EMPTY

    def seal(self, slot: int, version: int, generation: int) -> None:
        """``slot`` holds all of ``version`` now: make each chunk's record count (checksum pending)."""
        rec = self.records[slot]
        for i in range(self.num_chunks):
            faults.hit("keeper_seal", i)
            rec[i, 1] = CRC_PENDING
            rec[i, 2] = generation
            rec[i, 0] = version  # last: the record counts from here on

    def commit(self, slot: int, version: int, crcs: list[int] | None = None) -> None:
        """Write the CRC-32C of each chunk of sealed ``version`` in ``slot`` (``crcs``: computed
        by the caller in its own pass over the bytes, else here)."""
        if crcs is None:
            data = memoryview(self._data[slot])
            crcs = [checksum.crc32(data[i * self.chunk_bytes:(i + 1) * self.chunk_bytes]) for i in range(self.num_chunks)]
        if len(crcs) != self.num_chunks:
            raise ValueError(f"{len(crcs)} chunk checksums for a segment of {self.num_chunks} chunks")
        rec = self.records[slot]
        for i, crc in enumerate(crcs):
            faults.hit("keeper_commit", i)
            if self._stop:
                return
            if rec[i, 0] != version:
                return  # overwritten since (a newer update began): its own seal and commit follow
            rec[i, 1] = crc

    def device_begin(self) -> None:
        """The device copy is about to be overwritten: it counts no more."""
        self.device_rec[0] = EMPTY

    def device_seal(self, version: int, total: int, generation: int) -> None:
        """The device copy holds ``version``'s tensors, whose :func:`~hotspare.devicemem.device_sum` is ``total``."""
        self.device_rec[1] = total
        self.device_rec[2] = generation
        self.device_rec[0] = version  # last: the record counts from here on

    def device_record(self) -> tuple[int, int]:
        """(version, device sum) of the device copy; version EMPTY when it holds none."""
        return int(self.device_rec[0]), int(self.device_rec[1])

    def freeze(self) -> None:
        """No commit writes another record after this (the writer's generation failed)."""
        self._stop = True

    def thaw(self) -> None:
        """Commits write again (the next generation's writer took the segment over)."""
        self._stop = False

    # ---- readers ------------------------------------------------------------------------------

    def complete_versions(self) -> dict[int, int]:
        """{version: slot} of each slot whose chunks all hold the same committed version."""
        out = {}
        for slot in range(self.num_slots):
            versions = self.records[slot, :, 0]
            v = int(versions[0])
            if v != EMPTY and bool((versions == v).all()):
                out[v] = slot
        return out

    def verify(self, slot: int) -> list[int]:
        """Chunks of ``slot`` whose bytes do not match their record's CRC-32C (empty: all good;
        chunks whose checksum is pending are not counted, see :meth:`unverified`)."""
        data = memoryview(self._data[slot])
        rec = self.records[slot]
        return [i for i in range(self.num_chunks) if int(rec[i, 1]) != CRC_PENDING
                and checksum.crc32(data[i * self.chunk_bytes:(i + 1) * self.chunk_bytes]) != int(rec[i, 1])]

    def unverified(self, slot: int) -> list[int]:
        """Chunks of ``slot`` sealed whose checksum is still pending (the writer died before its round)."""
        return [i for i in range(self.num_chunks) if int(self.records[slot, i, 1]) == CRC_PENDING]

    def verified_versions(self) -> dict[int, int]:
        """:meth:`complete_versions` less any slot with a chunk that fails its checksum (chunks
        still pending count as good: see the module's note)."""
        return {v: s for v, s in self.complete_versions().items() if not self.verify(s)}

    def versions_by_slot(self) -> list[int]:
        """The complete version of each slot (-1 for an incomplete one)."""
        held = {s: v for v, s in self.complete_versions().items()}
        return [held.get(s, EMPTY) for s in range(self.num_slots)]

    def close(self) -> None:
        """Unmap (the file stays: it is the keeper's). Views handed out must be gone by now."""
        self.records = self.device_rec = None
        self._data, self._slots = [], []
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it


class RetainedSnapshots:
    """A mirror's own snapshot buffers in a retained segment (see :class:`hotspare.slots.Snapshots`).

    A segment the budget cut to one slot gets a private second buffer: the mirror still keeps
    two versions, the keeper only the one in slot 0.
    """

    retained = True

    def __init__(self, segment: RetainedSegment, layout, pin_memory: bool = False, device=None):
        if (segment.layout_id, segment.nbytes) != (layout.id, layout.nbytes):
            raise SegmentError(f"{segment.path} holds layout {segment.layout_id:x} ({segment.nbytes} bytes), not this "
                               f"rank's {layout.id:x} ({layout.nbytes} bytes)")
        self.segment = segment
        self.device = device
        """The keeper's device copy (a uint8 CUDA tensor of the layout's size), or None."""
        self._device_sum = None  # (slot, 0-d device tensor) of the copy in flight
        self.buffers = list(segment.slots) + [layout.allocate(pin_memory) for _ in range(2 - segment.num_slots)]
        # On an accelerator the segment's slots are page-locked in place, so the mirror's
        # device-to-host capture into them is asynchronous as into its own pinned buffers.
        self._registered = []
        if pin_memory:
            from .snapshot import register_host

            self._registered = [b for b in segment.slots if register_host(b)]

    def versions(self) -> list[int]:
        return self.segment.versions_by_slot() + [EMPTY] * (2 - self.segment.num_slots)

    @property
    def chunk_bytes(self) -> int:
        return self.segment.chunk_bytes

    def begin(self, slot: int) -> None:
        if slot < self.segment.num_slots:
            self.segment.begin(slot)

    def seal(self, slot: int, version: int, generation: int) -> None:
        if slot < self.segment.num_slots:
            self.segment.seal(slot, version, generation)
        if self._device_sum is not None and self._device_sum[0] == slot:
            total = int(self._device_sum[1])  # the copy's event fired: no wait
            self._device_sum = None
            self.segment.device_seal(version, total, generation)

    def device_begin(self) -> None:
        self._device_sum = None
        self.segment.device_begin()

    def device_written(self, slot: int, total) -> None:
        self._device_sum = (slot, total)

    def commit(self, slot: int, version: int, chunk_crcs: list[int]) -> None:
        if slot < self.segment.num_slots:
            self.segment.commit(slot, version, chunk_crcs)

    def freeze(self) -> None:
        self.segment.freeze()

    def thaw(self) -> None:
        self.segment.thaw()

    def close(self) -> None:
        if self._registered:
            from .snapshot import unregister_host

            for b in self._registered:
                unregister_host(b)
            self._registered = []
        self.buffers = []
        self.device = self._device_sum = None
        self.segment.close()
