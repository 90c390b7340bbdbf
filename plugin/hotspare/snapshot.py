"""Snapshots: a rank's unique state packed into one preallocated flat byte buffer.

A snapshot is a fixed layout of segments (name, dtype, numel) at 64-byte-aligned offsets plus
a metadata area holding a length-prefixed UTF-8 JSON document (counters, scheduler, RNG
states of Python and NumPy). What travels is these raw bytes and a small fixed header of
int64 fields (:class:`Header`); nothing received is ever unpickled.

The layout is fixed after warm-up: capturing copies into views made once, so the per-step
path allocates nothing proportional to model size.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch

from . import accelerator, checksum

ALIGN = 64
# Metadata is counters, scheduler and optimizer hyper-parameters, RNG leftovers and the data
# position: about 1-2 KB as JSON. It is sent every step, so its area stays small.
META_CAPACITY = 16 * 1024
MAGIC = 0x48535031  # "HSP1"
HEADER_FIELDS = ("magic", "generation", "version", "source", "nbytes", "crc32", "layout_id", "flags", "share",
                 "total_nbytes", "total_crc32", "k", "m")
HEADER_LEN = len(HEADER_FIELDS)

DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                              torch.int32, torch.uint8, torch.int8, torch.bool)}


@dataclass(frozen=True)
class Segment:
    name: str
    dtype: torch.dtype
    numel: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class Layout:
    """Where each named tensor lives inside a snapshot buffer."""

    def __init__(self, specs: list[tuple[str, torch.dtype, int]], meta_capacity: int = META_CAPACITY):
        self.meta_capacity = meta_capacity
        offset = _align(4 + meta_capacity)
        segments = []
        for name, dtype, numel in specs:
            seg = Segment(name, dtype, int(numel), offset)
            segments.append(seg)
            offset = _align(offset + seg.nbytes)
        self.segments = segments
        self.nbytes = offset
        self.tensors_offset = _align(4 + meta_capacity)
        """Where the tensors start (the metadata area comes first)."""
        desc = json.dumps([[s.name, str(s.dtype), s.numel, s.offset] for s in segments] + [meta_capacity])
        # A 52-bit id of the layout: a receiver refuses bytes laid out differently.
        self.id = int.from_bytes(hashlib.sha256(desc.encode()).digest()[:8], "little") >> 12

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]], meta_capacity: int = META_CAPACITY) -> "Layout":
        return cls([(n, t.dtype, t.numel()) for n, t in named], meta_capacity)

    def matches(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        return len(named) == len(self.segments) and all(
            s.name == n and s.dtype == t.dtype and s.numel == t.numel() for s, (n, t) in zip(self.segments, named))

    def allocate(self, pin: bool = False) -> torch.Tensor:
        buf = torch.zeros(self.nbytes, dtype=torch.uint8)
        if pin:
            buf = accelerator.get().pin_memory(buf)
        return buf

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Typed 1-D views of each segment of ``buf`` (made once per buffer)."""
        assert buf.dtype == torch.uint8 and buf.numel() == self.nbytes
        return [buf[s.offset:s.offset + s.nbytes].view(s.dtype) for s in self.segments]


def register_host(buf: torch.Tensor) -> bool:
    """Page-lock ``buf`` where it is (memory this process did not allocate: a keeper's shared
    mapping), so that device-to-host copies into it run asynchronously. True when it is
    registered; False where the accelerator has no such call (DeepSpeed's CPU accelerator, or
    one that is not CUDA/ROCm): copies into ``buf`` are then synchronous, still correct.
    Undo with :func:`unregister_host` before the memory is unmapped."""
    if accelerator.get().device_name() != "cuda" or not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel() * buf.element_size()} bytes of shared memory failed "
                           f"({err}); is the locked-memory limit (ulimit -l) too low? Set hotspare.retain.keeper "
                           f"to false to keep the mirror's buffers in this process's own pinned memory")
    return True


def unregister_host(buf: torch.Tensor) -> None:
    """Undo :func:`register_host` (the device must be done with ``buf``)."""
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_meta(buf: torch.Tensor, layout: Layout, meta: dict) -> None:
    data = json.dumps(meta, separators=(",", ":")).encode()
    if len(data) > layout.meta_capacity:
        raise ValueError(f"snapshot metadata is {len(data)} bytes, more than its {layout.meta_capacity}-byte area; "
                         f"keep the data_state passed to hotspare.initialize to a few numbers")
    raw = buf.numpy()
    raw[:4] = memoryview(struct.pack("<I", len(data)))
    raw[4:4 + len(data)] = memoryview(data)


def read_meta(buf: torch.Tensor, layout: Layout) -> dict:
    raw = buf.numpy()
    (n,) = struct.unpack("<I", raw[:4].tobytes())
    if n > layout.meta_capacity:
        raise ValueError(f"snapshot metadata length {n} exceeds its area ({layout.meta_capacity}); corrupt snapshot")
    return json.loads(raw[4:4 + n].tobytes())


def crc32(buf: torch.Tensor, nbytes: int | None = None) -> int:
    """CRC-32C of the buffer's first ``nbytes`` (:mod:`hotspare.checksum`; the GIL is released)."""
    return checksum.crc32(memoryview(buf.numpy())[:nbytes if nbytes is not None else buf.numel()])


@dataclass
class Header:
    """The typed header that precedes every snapshot on the wire (int64 fields, no pickle)."""

    generation: int
    version: int
    source: int
    nbytes: int
    crc32: int
    layout_id: int
    flags: int = 0
    share: int = -1
    """-1: the payload is the whole snapshot; else the index of the stripe share it is (0..k+m-1)."""
    total_nbytes: int = 0
    """A share: bytes of the whole snapshot it is part of."""
    total_crc32: int = 0
    """A share: CRC-32 of the whole snapshot."""
    k: int = 0
    m: int = 0
    magic: int = MAGIC

    def to_tensor(self, out: torch.Tensor) -> torch.Tensor:
        out.copy_(torch.tensor([getattr(self, f) for f in HEADER_FIELDS], dtype=torch.int64))
        return out

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Header":
        values = dict(zip(HEADER_FIELDS, (int(x) for x in t.tolist())))
        return cls(**values)
