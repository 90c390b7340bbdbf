"""The worker's half of an in-place recovery, independent of the host framework.

After the coordinator's plan for generation g+1 is out and every member has joined it (see
:mod:`hotspare.rebuild` for the groups), every rank of g+1 runs the same three steps:

1. :func:`exchange_holdings`: one all-gather of what each rank holds (its own snapshots'
   versions, its held copies' versions, its measured send rate) as int64, so that every rank
   computes the same :class:`~hotspare.planning.RestorePlan` with no one sending it;
2. :func:`start_fetch`: a rank a spare took receives its landing version's bytes from the holders
   of its mirror, split across them by :func:`~hotspare.planning.split_load`; the header
   (version, source, layout id, CRC-32C) is checked before the bytes are used;
3. the host integration restores from those bytes (survivors: from their own snapshot of
   the same version, never from live state that may be half-way through a step).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from . import erasure
from .errors import FatalError, RecoverableError
from .mirror import Mirror
from .slots import NO_VERSION
from .planning import KEEPER, SELF, STRIPE, Holdings, RestorePlan, split_load
from .snapshot import HEADER_LEN, MAGIC, Header, Layout, crc32
from .transport import GlooTransport

TAG_RESTORE_HEADER = 81
TAG_RESTORE_DATA = 82


class RecoveryError(FatalError):
    """Recovery cannot go on; the message says what was lost and what to do."""


class GenerationFailed(RecoverableError):
    """Raised in the training thread (a module's forward) once the coordinator has said that this
    worker's generation failed: it leaves for the recovery now instead of at its next collective."""


# Messages of the errors a collective raises when a peer died or the group broke (gloo's tcp
# transport, NCCL); a training step that raises anything else has a bug, which recovery must
# not hide. Kept specific: a user error that merely mentions a "timeout" is not a fault.
_DISTRIBUTED_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                        "connection refused", "timed out waiting", "gloo/transport", "read error [",
                        "write error [", "nccl error", "ncclremoteerror", "ncclsystemerror",
                        "process group has been aborted", "processgroup has been shut down")


def is_distributed_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer or the group failed (as opposed to a bug in the step, or a
    failure nothing in place can mend): by type (hotspare's, then torch's), and for a plain
    ``RuntimeError`` by gloo's or NCCL's text (see :mod:`hotspare.errors`)."""
    if isinstance(exc, FatalError):
        return False
    if isinstance(exc, (RecoverableError, TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, (dist.DistError, dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(m in text for m in _DISTRIBUTED_MARKERS)
    return False


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that gave up waiting (not a peer that reported an error)."""
    return isinstance(exc, TimeoutError) or (isinstance(exc, RuntimeError) and "timed out" in str(exc).lower())


def exchange_holdings(group, world_size: int, mirror: Mirror | None, retained=()) -> list[Holdings]:
    """All-gather every rank's :class:`Holdings` over ``group`` (a gloo group of the new generation).

    ``mirror`` is this rank's mirror of the failed generation, stopped (None for a spare);
    ``retained``: the versions of this rank's state its node's keeper holds, verified (a spare).
    Encoding: [own_a, own_b, send_rate, kept_a, kept_b, then for each source s: two versions
    held of s, then for each source s: two versions of which a stripe share of s is held], -1 for none.
    """
    w = world_size
    mine = torch.full((5 + 4 * w,), NO_VERSION, dtype=torch.int64)
    for i, v in enumerate(sorted(retained)[-2:]):
        mine[3 + i] = v
    if mirror is not None:
        own, held = mirror.holdings()
        for i, v in enumerate(sorted(own)[-2:]):
            mine[i] = v
        mine[2] = int(mirror.stats.send_rate)
        for base, table in ((5, held), (5 + 2 * w, mirror.share_holdings())):
            for src, versions in table.items():
                if src < w:
                    for i, v in enumerate(sorted(versions)[-2:]):
                        mine[base + 2 * src + i] = v
    out = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    holdings = []
    for t in out:
        v = [int(x) for x in t.tolist()]
        def table(base: int) -> dict[int, frozenset[int]]:
            got = {s: frozenset(x for x in v[base + 2 * s:base + 2 + 2 * s] if x != NO_VERSION) for s in range(w)}
            return {s: vs for s, vs in got.items() if vs}

        holdings.append(Holdings(own=frozenset(x for x in v[:2] if x != NO_VERSION),
                                 held=table(5), shares=table(5 + 2 * w),
                                 send_rate=float(max(0, v[2])),
                                 retained=frozenset(x for x in v[3:5] if x != NO_VERSION)))
    return holdings


class PendingFetch:
    """A restore transfer in flight (see :func:`start_fetch`); :meth:`wait` completes it."""

    def __init__(self, handles, finish: Callable[[], tuple[torch.Tensor, Layout]] | None, stats, t0: float,
                 timeout_s: float):
        self._handles, self._finish, self.stats = handles, finish, stats
        self._t0, self._timeout_s = t0, timeout_s

    def wait(self) -> tuple[tuple[torch.Tensor, Layout] | None, dict]:
        """Wait for every byte; returns ((bytes, layout) on a rank a spare took, else None; stats)."""
        for handle in self._handles:
            handle.wait(self._timeout_s)
        received = self._finish() if self._finish is not None else None
        self.stats["transfer_s"] = time.perf_counter() - self._t0
        return received, self.stats


def start_fetch(plan: RestorePlan, rank: int, new_ranks: list[int], holdings: list[Holdings], mirror: Mirror | None,
                layout_for: Callable[[int], Layout | None], group, timeout_s: float) -> PendingFetch:
    """Start moving the landing version's bytes to every rank a spare took; returns at once with
    the bytes in flight (what the caller does next, building the host's groups, overlaps them).

    Every rank runs this with the same arguments (the plan is computed everywhere): holders
    send their share of each new rank's copy of ``plan.version``, new ranks receive.
    ``layout_for(layout_id)`` gives the receiving engine's layout with that id (None: it has
    none). The split needs the byte count on every rank: the first holder's header carries it
    (the receiver waits for that header here), and every holder knows it. A rank decoded from
    a stripe gets the share of every live share holder (k of them are needed: the others
    stand in for a share that fails its checksum).
    """
    t0 = time.perf_counter()
    transport = GlooTransport(group, rank)
    handles, finish = [], None
    stats = {"bytes_in": 0, "bytes_out": 0, "sources": []}
    for r in sorted(new_ranks):
        holders = plan.sources[r]
        if holders == (SELF,):
            raise RecoveryError(f"rank {r} was taken by a spare but the plan restores it from itself")
        if holders == (KEEPER,):
            continue  # restored from its node's keeper: nothing crosses the network
        if holders[0] == STRIPE:
            use = holders[1:]
            if rank == r:
                finish, recvs, stats["bytes_in"] = _start_receive_shares(r, plan.version, use, layout_for, transport,
                                                                         timeout_s)
                handles += recvs
                stats["sources"] = ["stripe", *use]
            elif rank in use:
                header, share = mirror.held_copy(r, plan.version)
                handles.append(transport.send(header.to_tensor(torch.zeros(HEADER_LEN, dtype=torch.int64)), r,
                                              TAG_RESTORE_HEADER))
                handles.append(transport.send(share, r, TAG_RESTORE_DATA))
                stats["bytes_out"] += share.numel()
            continue
        rates = [holdings[h].send_rate for h in holders]
        if rank == r:
            header, buf, layout, recvs = _start_receive(r, plan.version, holders, rates, layout_for, transport,
                                                        timeout_s)
            handles += recvs
            finish = functools.partial(_check_copy, r, holders, header, buf, layout)
            stats["bytes_in"] = layout.nbytes
            stats["sources"] = list(holders)
            continue
        if rank not in holders:
            continue
        header, buf = mirror.held_copy(r, plan.version)
        mine = [(off, n) for h, off, n in split_load(header.nbytes, holders, rates) if h == rank]
        if holders[0] == rank:
            handles.append(transport.send(header.to_tensor(torch.zeros(HEADER_LEN, dtype=torch.int64)), r,
                                          TAG_RESTORE_HEADER))
        for off, n in mine:
            handles.append(transport.send(buf[off:off + n], r, TAG_RESTORE_DATA))
            stats["bytes_out"] += n
    return PendingFetch(handles, finish, stats, t0, timeout_s)


def _check_copy(r: int, holders, header: Header, buf: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, Layout]:
    # Only the first holder's header is checked; the CRC-32C over the assembled bytes catches a
    # part from any holder whose copy differs.
    if crc32(buf) != header.crc32:
        raise RecoveryError(f"rank {r}: the restored state fails its CRC-32C check (holders {list(holders)}); it is "
                            f"not used")
    return buf, layout


def _start_receive_shares(r: int, version: int, holders, layout_for, transport: GlooTransport, timeout_s: float):
    """Post the receives of one share from each of ``holders``; the returned ``finish`` decodes them."""
    headers, bufs, recvs = [], [], []
    for h in holders:
        header_t = torch.zeros(HEADER_LEN, dtype=torch.int64)
        transport.recv(header_t, h, TAG_RESTORE_HEADER).wait(timeout_s)
        header = Header.from_tensor(header_t)
        if header.magic != MAGIC or header.source != r or header.version != version or header.share < 0:
            raise RecoveryError(f"rank {r}: the share header from rank {h} is for rank {header.source} version "
                                f"{header.version} share {header.share}, expected a share of version {version}")
        buf = torch.zeros(header.nbytes, dtype=torch.uint8)
        recvs.append(transport.recv(buf, h, TAG_RESTORE_DATA))
        headers.append(header)
        bufs.append(buf)
    first = headers[0]
    layout = layout_for(first.layout_id)
    if layout is None or first.total_nbytes != layout.nbytes:
        raise RecoveryError(f"rank {r}: the striped state's layout ({first.total_nbytes} bytes, id "
                            f"{first.layout_id:x}) is not one of this engine's; is the spare running the same script, "
                            f"model and config as the job?")

    def finish() -> tuple[torch.Tensor, Layout]:
        crcs = [0] * (first.k + first.m)
        for header in headers:
            crcs[header.share] = header.crc32
        info = erasure.StripeInfo(first.k, first.m, first.total_nbytes, first.nbytes, tuple(crcs), first.total_crc32)
        try:
            data = erasure.decode(info, {header.share: buf.numpy() for header, buf in zip(headers, bufs)})
        except erasure.ErasureError as exc:
            raise RecoveryError(f"rank {r}: {exc} (share holders {list(holders)})") from None
        out = layout.allocate()
        out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        return out, layout

    return finish, recvs, sum(b.numel() for b in bufs)


def _start_receive(r: int, version: int, holders, rates, layout_for, transport: GlooTransport, timeout_s: float):
    first = holders[0]
    header_t = torch.zeros(HEADER_LEN, dtype=torch.int64)
    transport.recv(header_t, first, TAG_RESTORE_HEADER).wait(timeout_s)
    h = Header.from_tensor(header_t)
    if h.magic != MAGIC or h.source != r or h.version != version:
        raise RecoveryError(f"rank {r}: the restore header from rank {first} is for rank {h.source} version "
                            f"{h.version}, expected version {version}")
    layout = layout_for(h.layout_id)
    if layout is None or h.nbytes != layout.nbytes:
        raise RecoveryError(f"rank {r}: the mirrored state's layout ({h.nbytes} bytes, id {h.layout_id:x}) is not "
                            f"one of this engine's; is the spare running the same script, model and config as "
                            f"the job?")
    buf = layout.allocate()
    recvs = [transport.recv(buf[off:off + n], src, TAG_RESTORE_DATA) for src, off, n in split_load(h.nbytes, holders,
                                                                                                     rates)]
    return h, buf, layout, recvs
