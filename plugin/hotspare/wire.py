"""How one snapshot (a full copy, or one stripe share) crosses a transport.

Every transfer starts with one message: its header followed by the first
``min(nbytes, chunk_bytes, FUSED_BYTES)`` bytes of the payload (copied next to the header on both
sides); the rest follows in ``chunk_bytes`` messages. A small state is then one message per
holder instead of two: a message costs its two processes 0.2-0.3 ms of CPU here (gloo's loop
threads and torch's wrappers; measured with 1 KB), the copies 0.1 ms per MiB. The receiver posts
that first receive before it knows the size (gloo lands a message shorter than the buffer posted
for it at the buffer's start; pinned in tests/test_mirror_kill.py); the header says how many
bytes follow. A header is int64 fields at the start of the first message; payloads are raw
bytes. Nothing is unpickled.
"""
from __future__ import annotations

import dataclasses

import torch

from . import checksum, erasure
from .snapshot import HEADER_LEN, Header
from .transport import Transport

TAG_HEADER = 71
"""A transfer's first message: its header, then the payload's first bytes."""
TAG_DATA = 72
"""The rest of the payload, in ``chunk_bytes`` messages."""
FUSED_BYTES = 1 << 20
"""At most this many payload bytes travel behind the header in a transfer's first message."""
HEADER_BYTES = HEADER_LEN * 8


class Wire:
    """Frames, sends and receives transfers over ``transport``; the first messages going out are
    allocated once (one per holder for a stripe, each with its own share; one for all holders
    of a full copy)."""

    def __init__(self, transport: Transport, chunk_bytes: int, timeout_s: float):
        self.transport, self.chunk_bytes, self.timeout_s = transport, chunk_bytes, timeout_s
        self._firsts_out: list[torch.Tensor] = []
        self._striper: erasure.Striper | None = None
        self._share_out: list[torch.Tensor] = []  # parity shares going out

    def fused(self, nbytes: int) -> int:
        """Payload bytes that go in a transfer's first message, behind the header."""
        return min(nbytes, self.chunk_bytes, FUSED_BYTES)

    def frame(self, i: int, header: Header, payload: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """First message ``i`` of this round (the header, then ``payload``'s first bytes) and the
        payload after it, in ``chunk_bytes`` pieces (views of ``payload``)."""
        f = self.fused(payload.numel())
        while len(self._firsts_out) <= i:
            self._firsts_out.append(torch.zeros(0, dtype=torch.uint8))
        if self._firsts_out[i].numel() != HEADER_BYTES + f:
            self._firsts_out[i] = torch.zeros(HEADER_BYTES + f, dtype=torch.uint8)
        first = self._firsts_out[i]
        header.to_tensor(first[:HEADER_BYTES].view(torch.int64))
        first[HEADER_BYTES:].copy_(payload[:f])
        return first, self.rest(payload)

    def rest(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The payload after what the first message carries, in ``chunk_bytes`` pieces."""
        n = buf.numel()
        return [buf[i:i + self.chunk_bytes] for i in range(self.fused(n), n, self.chunk_bytes)]

    def post(self, first: torch.Tensor, rest: list[torch.Tensor], dst: int) -> list:
        """Send a framed transfer to ``dst``; the send handles (wait on each)."""
        return [self.transport.send(first, dst, TAG_HEADER),
                *(self.transport.send(chunk, dst, TAG_DATA) for chunk in rest)]

    def first_buffer(self) -> torch.Tensor:
        """A buffer big enough for any first message (a shorter one lands at its start)."""
        return torch.zeros(HEADER_BYTES + min(self.chunk_bytes, FUSED_BYTES), dtype=torch.uint8)

    def receive_first(self, first: torch.Tensor, src: int) -> Header:
        """Receive ``src``'s next first message into ``first``; its header (unchecked)."""
        self.transport.recv(first, src, TAG_HEADER).wait(self.timeout_s)
        return Header.from_tensor(first[:HEADER_BYTES].view(torch.int64))

    def receive_rest(self, incoming: torch.Tensor, first: torch.Tensor, src: int) -> None:
        """The whole payload into ``incoming`` (sized by the header): the first bytes from
        ``first``, the rest from ``src``."""
        handles = [self.transport.recv(chunk, src, TAG_DATA) for chunk in self.rest(incoming)]
        f = self.fused(incoming.numel())
        incoming[:f].copy_(first[HEADER_BYTES:HEADER_BYTES + f])
        for handle in handles:
            handle.wait(self.timeout_s)

    def send_shares(self, header: Header, buf: torch.Tensor, pieces: checksum.Pieces, holders: list[int], k: int,
                    m: int) -> tuple[list, int]:
        """Encode ``buf`` into k+m zfec shares and send share j to ``holders[j - 1]`` (j >= 1; share
        0 stays with the rank), each with ``header`` completed for it; returns the send handles
        and the bytes sent. Data shares go out as views of ``buf`` (unchanged until the round
        ends); parity shares through buffers allocated once."""
        if self._striper is None or self._striper.nbytes != buf.numel():
            self._striper = erasure.Striper(buf.numel(), k, m)
            self._share_out = [torch.zeros(self._striper.block, dtype=torch.uint8) for _ in range(m)]
        info, shares = self._striper.encode(buf.numpy(), pieces)
        sends, sent = [], 0
        for j, dst in enumerate(holders, start=1):
            if j < k:
                out = torch.from_numpy(shares[j])
            else:
                out = self._share_out[j - k]
                out.numpy()[:] = shares[j]
            h = dataclasses.replace(header, nbytes=info.block, crc32=info.share_crcs[j], share=j,
                                    total_nbytes=info.nbytes, total_crc32=info.crc, k=k, m=m)
            sends += self.post(*self.frame(j - 1, h, out), dst)
            sent += out.numel()
        return sends, sent
