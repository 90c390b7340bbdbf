"""Transports: how mirror bytes move between ranks. A small interface with two implementations.

- :class:`GlooTransport`: point-to-point isend/irecv on a dedicated gloo process group (host
  memory, TCP), never the training group, so mirror traffic never queues behind gradients.
- :class:`LocalTransport`: threads in one process, for fast protocol tests; it can also cut a
  rank off mid-transfer the way a dead process would.

Every wait takes an explicit timeout. tests/test_transport.py runs one contract over both.
"""
from __future__ import annotations

import datetime
import queue
import threading
from typing import Protocol

import torch

from .errors import RecoverableError


class TransferError(RecoverableError):
    """A send or receive failed or timed out; the message names the peer."""


class Handle(Protocol):
    def wait(self, timeout_s: float) -> None:
        """Block until done; raise TransferError on failure or after ``timeout_s``."""


class Transport(Protocol):
    rank: int

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        """Start sending ``tensor`` (contiguous, host memory) to ``dst``; matched by (src, dst, tag) order."""

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Handle:
        """Start receiving from ``src`` into ``tensor``: the matching send's bytes land at its
        start (a send longer than ``tensor`` fails; what the message says of its length is the
        caller's business, as with gloo)."""

    def close(self) -> None:
        """Release resources; pending operations fail."""


class _GlooHandle:

    def __init__(self, work, what: str):
        self.work, self.what = work, what

    def wait(self, timeout_s: float) -> None:
        try:
            self.work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # gloo raises RuntimeError subclasses for closed peers and timeouts
            raise TransferError(f"{self.what} failed: {exc}") from exc


class GlooTransport:
    """isend/irecv on ``group`` (a gloo group over all ranks of the generation)."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank

    def send(self, tensor, dst, tag):
        import torch.distributed as dist

        return _GlooHandle(dist.isend(tensor, dst=dst, group=self.group, tag=tag), f"send {self.rank}->{dst} tag {tag}")

    def recv(self, tensor, src, tag):
        import torch.distributed as dist

        return _GlooHandle(dist.irecv(tensor, src=src, group=self.group, tag=tag), f"recv {src}->{self.rank} tag {tag}")

    def close(self) -> None:
        self.group = None


class LocalFabric:
    """The shared medium of LocalTransport endpoints; ``cut(rank)`` kills a rank's traffic."""

    def __init__(self):
        self.lock = threading.Lock()
        self.channels: dict[tuple[int, int, int], queue.Queue] = {}
        self.dead: set[int] = set()

    def channel(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.channels.setdefault((src, dst, tag), queue.Queue())

    def cut(self, rank: int) -> None:
        with self.lock:
            self.dead.add(rank)

    def endpoint(self, rank: int) -> "LocalTransport":
        return LocalTransport(self, rank)


class _LocalSend:

    def __init__(self, fabric, tensor, src, dst):
        self.fabric, self.tensor, self.src, self.dst = fabric, tensor, src, dst
        self.done = threading.Event()
        self.error = None

    def wait(self, timeout_s):
        step, waited = 0.01, 0.0
        while not self.done.wait(step):
            waited += step
            if self.dst in self.fabric.dead or self.src in self.fabric.dead:
                raise TransferError(f"send {self.src}->{self.dst} failed: peer is gone")
            if waited >= timeout_s:
                raise TransferError(f"send {self.src}->{self.dst} timed out after {timeout_s} s")
        if self.error:
            raise TransferError(self.error)


class _LocalRecv:

    def __init__(self, fabric, tensor, src, dst, tag):
        self.fabric, self.tensor, self.src, self.dst, self.tag = fabric, tensor, src, dst, tag

    def wait(self, timeout_s):
        chan = self.fabric.channel(self.src, self.dst, self.tag)
        waited, step = 0.0, 0.01
        while True:
            if self.src in self.fabric.dead or self.dst in self.fabric.dead:
                raise TransferError(f"recv {self.src}->{self.dst} failed: peer is gone")
            try:
                msg = chan.get(timeout=step)
                break
            except queue.Empty:
                waited += step
                if waited >= timeout_s:
                    raise TransferError(f"recv {self.src}->{self.dst} timed out after {timeout_s} s") from None
        sent = msg.tensor.numel() * msg.tensor.element_size()
        if sent > self.tensor.numel() * self.tensor.element_size():
            msg.error = (f"{sent} bytes {self.src}->{self.dst} tag {self.tag} do not fit the "
                         f"{self.tensor.numel() * self.tensor.element_size()} bytes posted")
            msg.done.set()
            raise TransferError(msg.error)
        self.tensor.view(-1).view(torch.uint8)[:sent].copy_(msg.tensor.reshape(-1).view(torch.uint8))
        msg.done.set()


class LocalTransport:
    """One rank's endpoint on a LocalFabric (threads in one process)."""

    def __init__(self, fabric: LocalFabric, rank: int):
        self.fabric, self.rank = fabric, rank

    def send(self, tensor, dst, tag):
        if self.rank in self.fabric.dead:
            raise TransferError(f"send {self.rank}->{dst}: this rank is gone")
        msg = _LocalSend(self.fabric, tensor, self.rank, dst)
        self.fabric.channel(self.rank, dst, tag).put(msg)
        return msg

    def recv(self, tensor, src, tag):
        return _LocalRecv(self.fabric, tensor, src, self.rank, tag)

    def close(self) -> None:
        pass
