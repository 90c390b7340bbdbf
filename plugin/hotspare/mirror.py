"""Mirror: each rank's unique state copied into its holders' memory every iteration.

Per version v (the state after v optimizer steps) every rank runs one *round* on a
background thread: it sends its snapshot of v to its holders and receives each source's
snapshot of v, so the copy of v overlaps iteration v+1. Rounds are lock-step across ranks.
With ``in_flight='wait'`` every rank mirrors every version and each round ends with one tiny
MIN all-reduce on a control group, run by the mirror thread, that gives every rank the
globally committed version; the training thread waits only if the previous round is not done.
With ``'skip'`` that all-reduce runs at each step boundary on the training thread instead, so
that all ranks skip the same versions. Lock-step is what makes a consistent recovery
version exist: every rank keeps its own last two snapshots, every holder its sources' last
two committed ones, so the globally committed version G is on hand for every rank, even when
several ranks die at once with their copies at different versions (G for some, G+1 for
others): round G+2 cannot start anywhere before round G+1's agreement completed everywhere.

Every transfer (a full copy or a share) is one header-and-first-bytes message and the rest in
chunks (:mod:`hotspare.wire`).

A rank's own two snapshots live in buffers a :class:`hotspare.slots.Snapshots` provider gives
(its private memory, or its node keeper's shared memory); :mod:`hotspare.slots` also has the
copies it holds of its sources (:class:`~hotspare.slots.Copy`). How a snapshot crosses the
transport is :mod:`hotspare.wire`.

A round reads its snapshot once for every checksum it needs (:mod:`hotspare.checksum`): the
whole buffer's for the header, each keeper chunk's for the commit records, each data share's
with a stripe.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from . import checksum
from .capture import Capture
from .errors import RecoverableError
from .slots import NO_VERSION, Copy, Inherited, PrivateSnapshots, Snapshots, handed_over
from .snapshot import MAGIC, Header, Layout, crc32
from .transport import Transport
from .wire import Wire

_INT64_MAX = 2**63 - 1


class MirrorError(RecoverableError):
    """Mirroring cannot go on (a peer is gone or sent bad bytes); the message says which."""


@dataclass
class MirrorStats:
    rounds: int = 0
    waits: int = 0
    skips: int = 0
    bytes_sent: int = 0
    commit_failures: int = 0
    wait_s: float = 0.0
    capture_s: float = 0.0
    round_s: float = 0.0
    """Seconds the rounds took, sends and receives together (bytes_sent / round_s: a send rate)."""
    round_cpu_s: float = 0.0
    """CPU seconds the mirror thread spent in its rounds (what it takes from the trainer's cores)."""

    @property
    def send_rate(self) -> float:
        """Measured bytes/s this rank's rounds moved to its holders (0 before the first round)."""
        return self.bytes_sent / self.round_s if self.round_s > 0 else 0.0


class Mirror:
    """Drives the rounds of one rank. ``on_step`` from the training thread; the rest is background."""

    def __init__(self, rank: int, generation: int, holders: dict[int, list[int]], transport: Transport,
                 control: Callable[[torch.Tensor], None], *, in_flight: str = "wait", chunk_bytes: int = 4 << 20,
                 timeout_s: float = 60.0, pin_memory: bool = False, on_event: Callable[..., None] | None = None,
                 snapshots: Callable[[Layout], Snapshots] | None = None, stripe: tuple[int, int] | None = None,
                 inherit: Inherited | None = None):
        self.rank, self.generation = rank, generation
        self.stripe = stripe
        if stripe is None:
            self.holders = list(holders.get(rank, []))
            self.sources = sorted(s for s, hs in holders.items() if rank in hs)
        else:
            # ``holders[r]`` lists the holder of each of r's k+m shares; share 0 is in r's own
            # snapshot (its node's keeper), the others travel.
            assert all(len(hs) == sum(stripe) for hs in holders.values()), holders
            self.holders = list(holders[rank][1:])
            self.sources = sorted(s for s, hs in holders.items() if s != rank and rank in hs[1:])
        self._share_of = {s: holders[s].index(rank) for s in self.sources} if stripe else {}
        self._cuts: list[int] | None = None
        self._cuts_chunk: int | None = None
        self.transport, self.control = transport, control
        self.in_flight, self.chunk_bytes, self.timeout_s = in_flight, chunk_bytes, timeout_s
        self.wire, self.pin_memory = Wire(transport, chunk_bytes, timeout_s), pin_memory
        self.on_event = on_event or (lambda kind, **fields: None)
        self.own = Capture(generation, pin_memory, snapshots or (lambda layout: PrivateSnapshots(layout, pin_memory)),
                           self.on_event)
        self.stats = MirrorStats()
        self.enabled = True
        self._ctrl = torch.zeros(2, dtype=torch.int64)  # training thread's agreement ('skip')
        self._ctrl_bg = torch.zeros(2, dtype=torch.int64)  # mirror thread's agreement ('wait')
        self.copies = {s: Copy() for s in self.sources}
        if inherit is not None:
            inherit.snapshots.thaw()
            self.own.adopt(inherit.layout, inherit.snapshots, inherit.versions)
            if self.stripe is None:
                self.copies.update({s: c for s, c in inherit.copies.items() if s in self.copies})
        self.global_committed = NO_VERSION
        self._commit_lock = threading.Lock()
        self.error: BaseException | None = None
        self._rounds: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hotspare-mirror-{rank}", daemon=True)
        self._thread.start()

    # ---- training thread -------------------------------------------------------------------

    def on_step(self, version: int, tensors: Callable[[], list], meta: Callable[[], dict]) -> None:
        """Call after optimizer step ``version`` (the state now is 'after ``version`` steps')."""
        if not self.enabled:
            return
        self._raise_if_failed()
        if self.in_flight == "skip":
            # Skipping must be decided identically everywhere: one tiny collective says whether
            # any rank's round is still in flight.
            if self._agree(self._ctrl, busy=not self._idle.is_set()):
                self.stats.skips += 1
                self.on_event("mirror_skip", version=version)
                return
        elif not self._idle.is_set():
            # 'wait' needs no collective on the training thread: every round ends with an
            # agreement on the mirror thread, so an idle mirror means every rank's round is done
            # and global_committed is exact.
            t0 = time.perf_counter()
            self.on_event("mirror_waiting", version=version)  # the step waits for the round before
            self._wait_idle()
            self._raise_if_failed()
            self.stats.waits += 1
            self.stats.wait_s += time.perf_counter() - t0
            self.on_event("mirror_wait", version=version, wait_s=time.perf_counter() - t0)
        t0 = time.perf_counter()
        slot = self.own.capture(version, tensors(), meta(), keep=self.global_committed)
        self.stats.capture_s += time.perf_counter() - t0
        self._idle.clear()
        self._rounds.put((version, slot, frozenset(), frozenset()))

    def seed(self, version: int, tensors: Callable[[], list], meta: Callable[[], dict], *, reuse: bool = True,
             held_by: Collection[int] = (), held_from: Collection[int] = ()) -> None:
        """A new generation's first round, of the state as it is now (``version``), called on every
        rank right after the mirror is made. With ``reuse`` it goes out from the inherited snapshot
        of ``version`` when this rank has one (the state was restored from it): nothing is
        captured, so the buffer of the version before stays as it is. ``held_by``: this rank's
        holders that hold its ``version`` already; ``held_from``: the sources whose ``version``
        this rank holds already (the recovery's holdings exchange, the same on every rank): no
        transfer between them in this round, so the copy before it is not overwritten either.
        Until the round ends, a failure still finds ``version``, or the version before, of every
        rank on another node."""
        if not self.enabled:
            return
        named = tensors()
        if reuse and self.layout is not None and self.layout.matches(named) and version in self.own.versions:
            slot = self.own.versions.index(version)
        else:
            t0 = time.perf_counter()
            slot = self.own.capture(version, named, meta(), keep=self.global_committed)
            self.stats.capture_s += time.perf_counter() - t0
        skip_to, skip_from = frozenset(held_by), frozenset(held_from)
        if self.stripe is not None and (skip_to or skip_from):
            raise ValueError("a stripe's first round sends every share: held_by/held_from are for full copies")
        self._idle.clear()
        self._rounds.put((version, slot, skip_to, skip_from))

    def _agree(self, ctrl: torch.Tensor, busy: bool) -> bool:
        """One MIN all-reduce of [-busy, min committed over my sources] on the control group.

        Sets the globally committed version; returns whether any rank was busy.
        """
        ctrl[0] = -int(busy)
        ctrl[1] = min((c.version for c in self.copies.values()), default=_INT64_MAX)
        self.control(ctrl)
        self.global_committed = int(ctrl[1]) if int(ctrl[1]) != _INT64_MAX else NO_VERSION
        return int(ctrl[0]) < 0

    @property
    def layout(self) -> Layout | None:
        """The layout of this rank's snapshots (None before the first capture)."""
        return self.own.layout

    @property
    def snapshots(self) -> Snapshots | None:
        """Where this rank's own two snapshots live."""
        return self.own.snapshots

    def before_update(self) -> None:
        """Call before anything changes the captured state (the optimizer step): see
        :meth:`Capture.before_update`."""
        self.own.before_update()

    def hand_over(self, keep: int) -> Inherited | None:
        """After :meth:`stop` and the restore: this mirror's own buffers for the next generation's
        mirror, still holding every snapshot of ``keep`` (the version landed on) or older: those
        are of the timeline the job goes on with, and the one before ``keep`` is where a failure
        during the next generation's first round lands. A buffer of a later version is marked
        free (a retained one loses its records too). None when there are none, or when the
        background thread still runs (it could touch them); the buffers are then kept here."""
        if self.snapshots is None or self._thread.is_alive():
            return None
        layout, snapshots, versions = self.own.hand_over(keep)
        return Inherited(layout, snapshots, versions, self._copies_of(keep))

    def _copies_of(self, keep: int) -> dict[int, Copy]:
        """The full copies of version ``keep`` or older (:func:`hotspare.slots.handed_over`)."""
        return {} if self.stripe is not None else handed_over(self.copies, keep)

    def own_snapshot(self, version: int) -> torch.Tensor | None:
        """This rank's own snapshot of ``version``, if it still has it."""
        return self.own.find(version)

    def read_committed(self, source: int) -> tuple[int, torch.Tensor | None]:
        """(version, a copy of the bytes) of ``source``'s committed snapshot; safe while rounds run."""
        with self._commit_lock:
            copy = self.copies[source]
            if copy.committed is None:
                return NO_VERSION, None
            return copy.version, copy.committed.clone()

    @property
    def own_versions(self) -> tuple[int, int]:
        """The versions this rank's two snapshot slots hold (NO_VERSION for an empty or
        overwritten one)."""
        return tuple(self.own.versions)

    def flush(self, timeout_s: float | None = None) -> int:
        """Wait for the round in flight, agree once more, and return the globally committed version."""
        self._wait_idle(timeout_s)
        self._raise_if_failed()
        if self.in_flight == "skip":
            self._agree(self._ctrl, busy=False)
        return self.global_committed

    def settle(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, for the round in flight to end; True when it did. Its
        error, if any, is left for the next :meth:`on_step` to raise."""
        return self._idle.wait(timeout_s)

    def _wait_idle(self, timeout_s: float | None = None) -> None:
        limit = self.timeout_s * 2 if timeout_s is None else timeout_s
        if not self._idle.wait(limit):
            raise MirrorError(f"rank {self.rank}: a mirror round did not finish in {limit} s")

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise MirrorError(f"rank {self.rank}: mirroring stopped: {self.error}") from self.error

    def holdings(self) -> tuple[frozenset[int], dict[int, frozenset[int]]]:
        """(versions of this rank's own snapshots, {source: versions of its copies held}).

        Call after :meth:`stop`: then nothing changes under the caller.
        """
        own = frozenset(v for v in self.own.versions if v != NO_VERSION)
        if self.stripe is not None:
            return own, {}
        return own, self._held_versions()

    def tier2_bytes(self) -> int:
        """Bytes of state this rank holds so that the job survives a node loss: its own snapshot
        plus its committed copies (mirror), or its own share plus the shares it holds (stripe)."""
        if self.layout is None:
            return 0
        held = sum(c.committed.numel() for c in self.copies.values() if c.committed is not None)
        own = self.layout.nbytes if self.stripe is None else -(-self.layout.nbytes // self.stripe[0])
        return own + held

    def summary(self) -> dict:
        """What this rank's mirror did (JSON-able): placement, round counts and times, bytes."""
        st = self.stats
        return {"holders": self.holders, "sources": self.sources, "rounds": st.rounds, "waits": st.waits,
                "skips": st.skips, "bytes_sent": st.bytes_sent, "commit_failures": st.commit_failures,
                "wait_s": st.wait_s, "capture_s": st.capture_s, "round_s": st.round_s,
                "round_cpu_s": st.round_cpu_s, "snapshot_bytes": self.layout.nbytes if self.layout else 0,
                "tier2_bytes": self.tier2_bytes()}

    def share_holdings(self) -> dict[int, frozenset[int]]:
        """{source: versions of which this rank holds a stripe share} (empty for a full mirror)."""
        return self._held_versions() if self.stripe is not None else {}

    def _held_versions(self) -> dict[int, frozenset[int]]:
        held = {s: c.held() for s, c in self.copies.items()}
        return {s: vs for s, vs in held.items() if vs}

    def held_copy(self, source: int, version: int) -> tuple[Header, torch.Tensor]:
        """The copy of ``source`` at ``version`` (header, bytes), without a copy; call after :meth:`stop`."""
        found = self.copies[source].find(version)
        if found is None:
            raise MirrorError(f"rank {self.rank} holds no copy of rank {source} at version {version} (it holds "
                              f"{sorted(self.copies[source].held())})")
        return found

    def stop(self, join_s: float = 0.2) -> bool:
        """Freeze what this rank holds (a failure happened): no copy commits after this returns.

        The background thread is told to stop; what it may still do changes nothing that
        :meth:`holdings` reports (commits and the invalidation of the previous copy check the
        stop flag under the commit lock), so the recovery need not wait for it. A round blocked
        in a transfer ends with the transfer's error or its timeout; :meth:`join` waits for that.
        Returns whether the thread ended within ``join_s``. Buffers stay, for the restore.
        """
        self.own.all_landed()  # the restore reads this rank's own snapshots: their copies must have landed
        with self._commit_lock:
            self._stop.set()
            if self.snapshots is not None:
                self.snapshots.freeze()
        self.enabled = False
        self._rounds.put(None)
        return self.join(join_s)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the background thread to end (at most ``timeout_s``, default the transfer
        timeout plus 5 s: a blocked transfer gives up by then); returns whether it ended."""
        self._thread.join(timeout=self.timeout_s + 5 if timeout_s is None else timeout_s)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Stop the background thread (pending rounds are abandoned)."""
        self._stop.set()
        self._rounds.put(None)
        self._thread.join(timeout=self.timeout_s + 5)
        self.transport.close()
        self.own.all_landed()  # no device-to-host copy may still be writing into a buffer let go of
        if self.snapshots is not None:
            self.snapshots.close()

    # ---- background thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._rounds.get()  # blocks without polling; close() sends None
            if item is None or self._stop.is_set():
                return
            version, slot, skip_to, skip_from = item
            try:
                self._round(version, slot, skip_to, skip_from)
            except BaseException as exc:  # noqa: BLE001 - reported to the training thread
                self.error = exc
                self.on_event("mirror_failed", version=version, error=str(exc))
                self._idle.set()
                return
            self._idle.set()

    def _round(self, version: int, slot: int, skip_to: frozenset = frozenset(),
               skip_from: frozenset = frozenset()) -> None:
        """One round of ``version`` from ``slot``; ``skip_to``/``skip_from``: holders and sources
        that hold it already (a generation's first round, see :meth:`seed`)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        buf = self.own.buffers[slot]
        self.own.seal_landed(slot, version)
        holders = [h for h in self.holders if h not in skip_to]
        pieces = self._checksums(buf) if holders or self.snapshots.chunk_bytes is not None else None
        if self.snapshots.chunk_bytes is not None:
            self.snapshots.commit(slot, version, pieces.grid(self.snapshots.chunk_bytes))
        sends = []
        if self.stripe is None:
            if holders:
                header = Header(self.generation, version, self.rank, buf.numel(), pieces.whole(), self.layout.id)
                first, rest = self.wire.frame(0, header, buf)  # one frame, sent to every holder
            for dst in holders:
                sends += self.wire.post(first, rest, dst)
            sent = buf.numel() * len(holders)
        else:
            header = Header(self.generation, version, self.rank, 0, 0, self.layout.id)
            sends, sent = self.wire.send_shares(header, buf, pieces, self.holders, *self.stripe) if self.holders \
                else ([], 0)
        for src in self.sources:
            if src not in skip_from:
                self._receive(src, version)
        for h in sends:
            h.wait(self.timeout_s)
        if self.in_flight == "wait":
            self._agree(self._ctrl_bg, busy=False)
        self.stats.rounds += 1
        self.stats.bytes_sent += sent
        self.stats.round_s += time.perf_counter() - t0
        self.stats.round_cpu_s += time.thread_time() - c0

    def _checksums(self, buf: torch.Tensor) -> checksum.Pieces:
        """One pass over ``buf``, cut wherever a checksum this round needs starts or ends."""
        n = buf.numel()
        if self._cuts is None or self._cuts[-1] != n or self._cuts_chunk != self.snapshots.chunk_bytes:
            self._cuts_chunk = self.snapshots.chunk_bytes
            grids = [g for g in (self.snapshots.chunk_bytes,
                                 -(-n // self.stripe[0]) if self.stripe is not None else None) if g]
            self._cuts = checksum.cuts(n, *grids)
        return checksum.Pieces(buf.numpy(), self._cuts)

    def _receive(self, src: int, version: int) -> None:
        copy = self.copies[src]
        if copy.first is None:
            copy.first = self.wire.first_buffer()
        h = self.wire.receive_first(copy.first, src)
        if h.magic != MAGIC or h.source != src or h.generation != self.generation or h.version != version \
                or h.share != self._share_of.get(src, -1):
            raise MirrorError(f"rank {self.rank}: bad header from rank {src} (expected generation "
                              f"{self.generation} version {version} share {self._share_of.get(src, -1)}): {h}")
        with self._commit_lock:
            if self._stop.is_set():
                return  # frozen for a restore: what is held must stay as reported
            copy.make_room(h.nbytes)
        self.wire.receive_rest(copy.incoming, copy.first, src)
        if crc32(copy.incoming) != h.crc32:
            self.stats.commit_failures += 1
            self.on_event("mirror_checksum_failed", source=src, version=version)
            return  # the committed copy stays as it was
        if copy.committed is None:
            copy.committed = torch.zeros_like(copy.incoming)
        with self._commit_lock:
            if self._stop.is_set():
                return  # frozen for a restore: what is held must not change
            copy.commit(h)
        self.on_event("mirror_commit", source=src, version=version)
