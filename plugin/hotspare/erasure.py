"""Tier-2 erasure coding of a rank's snapshot with zfec (Leto's cross-node protection).

A snapshot of ``nbytes`` is cut into k equal blocks (the last one zero-padded) and zfec adds
m parity blocks: any k of the k+m *shares* rebuild it. Held on k+m distinct nodes
(:func:`place_shares`), a rank's state survives the loss of any m whole nodes, its own node
included, at (k+m)/k times its size instead of the mirror's 2x for one replica.

Every share carries the CRC-32C of its bytes and the CRC-32C of the whole snapshot
(:class:`StripeInfo`): a corrupted share is dropped before decoding and a decode that does not
reproduce the snapshot's CRC is refused, so a bad share is never used.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import zfec

from . import checksum
from .errors import HotspareError


class ErasureError(HotspareError, RuntimeError):
    """Too few good shares to rebuild a snapshot; the message says which are missing or bad."""


@dataclass(frozen=True)
class StripeInfo:
    """What a holder keeps next to its share: enough to check it and to decode with k of them."""

    k: int
    m: int
    nbytes: int
    """Bytes of the snapshot (before padding)."""
    block: int
    """Bytes of every share."""
    share_crcs: tuple[int, ...]
    """CRC-32C of each of the k+m shares, by share index."""
    crc: int
    """CRC-32C of the snapshot."""


def _crc(buf) -> int:
    return checksum.crc32(buf)


def check_km(k: int, m: int) -> None:
    if k < 1:
        raise ValueError(f"k={k} must be at least 1 (the data blocks a snapshot is cut into)")
    if m < 1:
        raise ValueError(f"m={m} must be at least 1: with no parity shares a lost node loses the state")
    if k + m > 256:
        raise ValueError(f"k+m={k + m} must be at most 256 (zfec's limit)")


class Striper:
    """Encodes snapshots of ``nbytes`` into k+m shares, again and again: the k data shares are
    views of the snapshot itself (of one padded buffer, allocated once, when k does not divide
    it), only the m parity shares are computed (zfec, which releases the GIL while it runs)."""

    def __init__(self, nbytes: int, k: int, m: int):
        check_km(k, m)
        self.nbytes, self.k, self.m = nbytes, k, m
        self.block = max(1, -(-nbytes // k))
        self._padded = None if nbytes == k * self.block else np.zeros(k * self.block, dtype=np.uint8)
        self._encoder = zfec.Encoder(k, k + m)

    def encode(self, data, pieces: checksum.Pieces | None = None) -> tuple[StripeInfo, list]:
        """(info, the k+m shares as uint8 arrays); data shares are views: valid while ``data`` is unchanged.

        ``pieces``: ``data``'s piece checksums cut at least at every multiple of :attr:`block`
        (the caller read the bytes once already); the data shares' and the whole snapshot's
        CRCs come from them, so only the parity shares are read for theirs."""
        raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        if raw.size != self.nbytes:
            raise ValueError(f"this striper encodes {self.nbytes} bytes, got {raw.size}")
        src = raw
        if self._padded is not None:
            self._padded[:self.nbytes] = raw
            src = self._padded
        b = self.block
        blocks = [src[i * b:(i + 1) * b] for i in range(self.k)]
        parity = self._encoder.encode(blocks, list(range(self.k, self.k + self.m)))
        shares = blocks + [np.frombuffer(p, dtype=np.uint8) for p in parity]
        if pieces is None:
            data_crcs, whole = [_crc(s) for s in blocks], _crc(raw)
        else:
            n, data_crcs = self.nbytes, []
            for lo in range(0, self.k * b, b):
                crc = pieces.crc(min(lo, n), min(lo + b, n))
                pad = lo + b - max(lo, n)  # zero padding at the end (fewer than k bytes in all)
                data_crcs.append(checksum.crc32(bytes(pad), crc) if pad > 0 else crc)
            whole = pieces.whole()
        info = StripeInfo(self.k, self.m, self.nbytes, b, tuple(data_crcs) + tuple(_crc(p) for p in shares[self.k:]),
                          whole)
        return info, shares


def encode(data, k: int, m: int) -> tuple[StripeInfo, list[bytes]]:
    """Cut ``data`` (any buffer: bytes, a uint8 numpy array or tensor's ``.numpy()``) into k+m shares."""
    striper = Striper(len(memoryview(data).cast("B")), k, m)
    info, shares = striper.encode(data)
    return info, [s.tobytes() for s in shares]


def decode(info: StripeInfo, shares: Mapping[int, object]) -> bytes:
    """The snapshot from any k good shares of ``shares`` (share index -> bytes).

    Shares whose CRC-32C does not match ``info`` are dropped. Raises :class:`ErasureError` when
    fewer than k good shares remain, or when the decoded bytes fail the snapshot's CRC-32C.
    """
    good, bad = {}, []
    for i, share in sorted(shares.items()):
        if not 0 <= i < info.k + info.m:
            raise ErasureError(f"share index {i} is outside 0..{info.k + info.m - 1}")
        if len(memoryview(share).cast("B")) != info.block or _crc(share) != info.share_crcs[i]:
            bad.append(i)
        else:
            good[i] = bytes(memoryview(share).cast("B"))
    if len(good) < info.k:
        missing = sorted(set(range(info.k + info.m)) - set(shares))
        raise ErasureError(f"{len(good)} good share(s), {info.k} needed (missing {missing}, failed their checksum "
                           f"{bad}); the snapshot cannot be rebuilt from this stripe")
    use = sorted(good)[:info.k]
    blocks = zfec.Decoder(info.k, info.k + info.m).decode(tuple(good[i] for i in use), tuple(use))
    out = b"".join(bytes(b) for b in blocks)[:info.nbytes]
    if _crc(out) != info.crc:
        raise ErasureError(f"the snapshot decoded from shares {use} fails its CRC-32C; not used")
    return out


def place_shares(nodes: Sequence[int], k: int, m: int) -> dict[int, list[int]]:
    """Which rank holds each of rank r's k+m shares: ``{r: [holder of share 0, ..., share k+m-1]}``.

    ``nodes[r]`` is rank r's node. Share 0 stays on r's own node (on r itself: the keeper's
    node), the others go to the next k+m-1 nodes in ring order, to the rank there with the same
    position on its node as r on its own, so every rank holds about as many shares as it owns.
    Raises ValueError when the job has fewer than k+m nodes (or uneven nodes).
    """
    check_km(k, m)
    order = sorted(set(nodes))
    if len(order) < k + m:
        raise ValueError(f"k+m={k + m} shares need {k + m} distinct nodes, the job has {len(order)}: lower k or m, "
                         f"or use the mirror for tier 2")
    members = {n: [r for r, node in enumerate(nodes) if node == n] for n in order}
    sizes = {len(v) for v in members.values()}
    if len(sizes) != 1:
        raise ValueError(f"nodes hold different numbers of ranks ({ {n: len(v) for n, v in members.items()} }); "
                         f"striping needs the same number of ranks on every node")
    out = {}
    for r, node in enumerate(nodes):
        pos, start = members[node].index(r), order.index(node)
        out[r] = [members[order[(start + j) % len(order)]][pos] for j in range(k + m)]
    return out
