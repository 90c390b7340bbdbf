"""hotspare.checksum: CRC-32C of pieces combined into the CRC of any range, against the crc32c
package reading the bytes (and the standard check value)."""
from __future__ import annotations

import random

import numpy as np
import pytest
from crc32c import crc32c

from hotspare import checksum, erasure


def test_combine_equals_the_crc_of_the_concatenation():
    assert checksum.crc32(b"123456789") == 0xE3069283  # CRC-32C's check value (RFC 3720)
    assert checksum.crc32(b"56789", checksum.crc32(b"1234")) == 0xE3069283  # continued
    rng = random.Random(0)
    for _ in range(300):
        a, b = rng.randbytes(rng.randint(0, 5000)), rng.randbytes(rng.randint(0, 5000))
        assert checksum.combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    big = rng.randbytes(1 << 20)  # a length with high bits: every squaring of the table used
    assert checksum.combine(crc32c(b"x"), crc32c(big), len(big)) == crc32c(b"x" + big)


@pytest.mark.parametrize("nbytes,grids", [(100_003, (4096, 33_334)), (8192, (4096,)), (7, (3, 5)), (1, (4096,))])
def test_pieces_give_every_chunk_share_and_the_whole(nbytes, grids):
    buf = np.frombuffer(random.Random(nbytes).randbytes(nbytes), dtype=np.uint8)
    pieces = checksum.Pieces(buf, checksum.cuts(nbytes, *grids))
    raw = buf.tobytes()
    assert pieces.whole() == crc32c(raw)
    for g in grids:
        assert pieces.grid(g) == [crc32c(raw[i:i + g]) for i in range(0, nbytes, g)]
    with pytest.raises(KeyError):  # only ranges between boundaries have a CRC without a read
        pieces.crc(0, nbytes + 1)


@pytest.mark.parametrize("nbytes", [1, 2, 5, 1001, 65_536, 99_999])
@pytest.mark.parametrize("k,m", [(1, 1), (2, 1), (3, 2), (7, 3)])
def test_a_striper_given_the_rounds_pieces_computes_the_same_share_checksums(nbytes, k, m):
    """The mirror passes its one-pass checksums; the shares' CRCs (padding included) must equal
    the ones computed by reading every share."""
    raw = np.frombuffer(random.Random(nbytes * k).randbytes(nbytes), dtype=np.uint8)
    striper = erasure.Striper(nbytes, k, m)
    read, _ = striper.encode(raw)
    given, _ = striper.encode(raw, checksum.Pieces(raw, checksum.cuts(nbytes, striper.block, 97)))
    assert given == read
