"""Where a rank's snapshots live: its own two (a :class:`Snapshots` provider: its private memory,
:class:`PrivateSnapshots`, or its node keeper's shared memory,
:class:`hotspare.retain.RetainedSnapshots`, where every update is a chunk-level transaction:
``begin`` before the capture writes a buffer, ``seal`` right after it, still on the training
thread, so that a trainer killed after its step leaves that version behind, and ``commit``, the
chunks' checksums, when its round starts), the copies it holds of its sources' (:class:`Copy`),
and what a failed generation hands to the next one (:class:`Inherited`).

A holder keeps the last committed copy of each source while the next arrives in a second
buffer; a copy commits (the buffers swap) only when every byte arrived and its CRC-32 matches
the header's. After the swap the second buffer still holds the copy committed before (the
*previous* version) until the next round starts to write into it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .snapshot import Header, Layout

NO_VERSION = -1
"""A slot or copy that holds no version."""


@dataclass
class Copy:
    """A source's snapshot held by this rank: a committed buffer and an incoming one."""

    committed: torch.Tensor | None = None
    incoming: torch.Tensor | None = None
    version: int = NO_VERSION
    first: torch.Tensor | None = None
    """Where the incoming transfer's first message lands: its header, then the payload's first
    bytes (overwritten by the next round)."""
    committed_header: Header | None = None
    """The header of the committed copy (its CRC and layout id are checked again at restore)."""
    previous_version: int = NO_VERSION
    """The copy committed before ``version``, still intact in ``incoming`` (NO_VERSION once a
    round writes there)."""
    previous_header: Header | None = None

    def make_room(self, nbytes: int) -> None:
        """Before a transfer of ``nbytes`` lands in ``incoming`` (the previous copy's buffer: it is
        no longer intact). Allocates only at warm-up or a layout change."""
        if self.incoming is None or self.incoming.numel() != nbytes:
            self.incoming = torch.zeros(nbytes, dtype=torch.uint8)
            if self.committed is not None and self.committed.numel() != nbytes:
                self.committed, self.version = None, NO_VERSION
        self.previous_version, self.previous_header = NO_VERSION, None

    def commit(self, header: Header) -> None:
        """``incoming`` arrived whole and checked: it becomes the committed copy, and the one
        committed before stays intact as the previous one."""
        self.committed, self.incoming = self.incoming, self.committed
        self.previous_version, self.previous_header = self.version, self.committed_header
        self.version, self.committed_header = header.version, header

    def held(self) -> frozenset[int]:
        """The versions held (committed and previous)."""
        return frozenset(v for v in (self.version, self.previous_version) if v != NO_VERSION)

    def find(self, version: int) -> tuple[Header, torch.Tensor] | None:
        """(header, bytes) of the copy of ``version``, without a copy; None if not held."""
        if self.committed is not None and self.committed_header is not None and self.version == version:
            return self.committed_header, self.committed
        if self.incoming is not None and self.previous_header is not None and self.previous_version == version:
            return self.previous_header, self.incoming
        return None


def handed_over(copies: dict[int, "Copy"], keep: int) -> dict[int, "Copy"]:
    """The full copies held of version ``keep`` or older, each source's newest as the committed
    copy and the one before it, if any, as the previous (a later version a survivor had committed
    is of a timeline the job just rolled back from: it must never be reported again, and its
    buffer is the one the next round writes)."""
    out = {}
    for src, c in copies.items():
        if c.committed is not None and NO_VERSION != c.version <= keep:
            prev = c.previous_version if c.incoming is not None and c.previous_header is not None else NO_VERSION
            out[src] = Copy(committed=c.committed, incoming=c.incoming, version=c.version,
                            committed_header=c.committed_header, previous_version=prev,
                            previous_header=c.previous_header if prev != NO_VERSION else None)
        elif NO_VERSION != c.previous_version <= keep and c.incoming is not None and c.previous_header is not None:
            out[src] = Copy(committed=c.incoming, incoming=c.committed, version=c.previous_version,
                            committed_header=c.previous_header)
    return out


class Snapshots:
    """Where a rank's own two snapshot buffers live, and how an update of one is made durable."""

    retained = False
    """Whether the buffers outlive this process (a keeper's shared memory)."""
    chunk_bytes: int | None = None
    """The chunk size whose checksums :meth:`commit` takes (None: it takes none)."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers

    def versions(self) -> list[int]:
        """The version each buffer holds already (a retained segment attached again), else NO_VERSION."""
        return [NO_VERSION] * len(self.buffers)

    def begin(self, slot: int) -> None:
        """Buffer ``slot`` is about to be overwritten."""

    def seal(self, slot: int, version: int, generation: int) -> None:
        """Buffer ``slot`` holds all of ``version`` now (the training thread, right after the capture)."""

    def commit(self, slot: int, version: int, chunk_crcs: list[int]) -> None:
        """The CRC-32 of each ``chunk_bytes`` chunk of sealed ``version`` (the round, off the training thread)."""

    device: torch.Tensor | None = None
    """The keeper's copy on the accelerator (``retain.device_tier``): the capture writes each
    tensor there too, device to device, on the mirror's stream."""

    def device_begin(self) -> None:
        """The device copy is about to be overwritten (the training thread, before the copy is issued)."""

    def device_written(self, slot: int, total: torch.Tensor) -> None:
        """The device copy of the capture into ``slot`` is issued; ``total`` (a 0-d device tensor,
        ready once the copy's event fired) is its :func:`~hotspare.devicemem.device_sum`, recorded
        by :meth:`seal`."""

    def freeze(self) -> None:
        """No commit after this (the generation failed)."""

    def thaw(self) -> None:
        """Commits again (the buffers were handed to the next generation's mirror)."""

    def close(self) -> None:
        """Let go of the buffers."""


@dataclass
class Inherited:
    """A failed generation's own snapshot buffers, handed to the next generation's mirror: no
    allocation (and, for retained ones, no request to the keeper) on the path back to training."""

    layout: Layout
    snapshots: Snapshots
    versions: list[int]
    """The version each buffer holds (NO_VERSION: free to overwrite)."""
    copies: dict[int, Copy] = field(default_factory=dict)
    """Full copies of other ranks' state at the landing version or older that this rank held:
    the new generation's first round sends the landing version only where it is not held yet,
    and never over the version before it, so that a failure during that round still finds every
    rank's state on another node (see :meth:`Mirror.seed`)."""


class PrivateSnapshots(Snapshots):
    """Both buffers in this process's own memory (pinned on an accelerator)."""

    def __init__(self, layout: Layout, pin_memory: bool = False):
        super().__init__([layout.allocate(pin_memory) for _ in range(2)])
