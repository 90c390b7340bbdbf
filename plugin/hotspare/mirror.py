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

Every transfer (a full copy or a share) starts with one message: its header followed by the
first ``min(nbytes, chunk_bytes, FUSED_BYTES)`` bytes of the payload (copied next to the header
on both sides); the rest follows in ``chunk_bytes`` messages. A small state is then one message
per holder instead of two: a message costs its two processes 0.2-0.3 ms of CPU here (gloo's
loop threads and torch's wrappers; measured with 1 KB), the copies 0.1 ms per MiB. The receiver
posts that first receive before it knows the size (gloo lands a message shorter than the buffer
posted for it at the buffer's start; pinned in tests/test_mirror_kill.py); the header says how
many bytes follow.

Receivers keep the last committed copy of each source while the next arrives in a second
buffer; a copy commits (the buffers swap) only when every byte arrived and its CRC-32 matches
the header's. After the swap the second buffer still holds the copy committed before (the
*previous* version) until the next round starts to write into it. A header is int64 fields at
the start of the first message; payloads are raw bytes. Nothing is unpickled.

A rank's own two snapshots live in buffers a :class:`Snapshots` provider gives: its private
memory (:class:`PrivateSnapshots`), or its node keeper's shared memory
(:class:`hotspare.retain.RetainedSnapshots`), where every update is a chunk-level
transaction: ``begin`` before the capture writes a buffer, ``seal`` right after it (still on
the training thread: a trainer killed after its step leaves that version behind), ``commit``
(the chunks' checksums) when its round starts.

A round reads its snapshot once for every checksum it needs (:mod:`hotspare.checksum`): the
whole buffer's for the header, each keeper chunk's for the commit records, each data share's
with a stripe.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from . import accelerator, checksum, erasure, faults
from .devicemem import device_sum
from .errors import RecoverableError
from .snapshot import HEADER_LEN, MAGIC, Header, Layout, crc32, write_meta
from .transport import Transport

TAG_HEADER = 71
"""A transfer's first message: its header, then the payload's first bytes."""
TAG_DATA = 72
"""The rest of the payload, in ``chunk_bytes`` messages."""
FUSED_BYTES = 1 << 20
"""At most this many payload bytes travel behind the header in a transfer's first message."""
HEADER_BYTES = HEADER_LEN * 8
NO_VERSION = -1
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
        self._share_out: list[torch.Tensor] = []
        self._striper: erasure.Striper | None = None
        self._cuts: list[int] | None = None
        # First messages going out (header + the payload's first bytes): one per holder for a
        # stripe (each gets its own share), one for all holders of a full copy.
        self._firsts_out: list[torch.Tensor] = []
        self.transport, self.control = transport, control
        self.in_flight, self.chunk_bytes, self.timeout_s = in_flight, chunk_bytes, timeout_s
        self.pin_memory = pin_memory
        self._make_snapshots = snapshots or (lambda layout: PrivateSnapshots(layout, pin_memory))
        self.snapshots: Snapshots | None = None
        # On an accelerator the capture is asynchronous: the device-to-host copies run on a
        # stream of their own into pinned buffers, the training thread goes on at once, the
        # mirror thread waits for the copy's event before it seals, checksums and sends, and
        # the next optimizer step waits for it on the device (:meth:`before_update`).
        self._acc = self._stream = None
        self._copied: list = [None, None]  # per slot: the event of its copy in flight
        self._fence = None  # the newest copy's event: sources must not change before it
        if pin_memory:
            acc = accelerator.get()
            if acc.Stream is not None:  # no streams (a CPU accelerator): the capture stays synchronous
                self._acc, self._stream = acc, acc.Stream()
        self.on_event = on_event or (lambda kind, **fields: None)
        self.stats = MirrorStats()
        self.enabled = True
        self.layout: Layout | None = None
        self._own: list[torch.Tensor] = []
        self._own_views: list[list[torch.Tensor]] = []
        self._own_version = [NO_VERSION, NO_VERSION]
        self._ctrl = torch.zeros(2, dtype=torch.int64)  # training thread's agreement ('skip')
        self._ctrl_bg = torch.zeros(2, dtype=torch.int64)  # mirror thread's agreement ('wait')
        self._device_views: list[torch.Tensor] | None = None  # typed views of snapshots.device
        self.copies = {s: Copy() for s in self.sources}
        if inherit is not None:
            inherit.snapshots.thaw()
            self._adopt(inherit.layout, inherit.snapshots, inherit.versions)
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
            self._wait_idle()
            self._raise_if_failed()
            self.stats.waits += 1
            self.stats.wait_s += time.perf_counter() - t0
            self.on_event("mirror_wait", version=version, wait_s=time.perf_counter() - t0)
        t0 = time.perf_counter()
        slot = self._capture(version, tensors(), meta())
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
        if reuse and self.layout is not None and self.layout.matches(named) and version in self._own_version:
            slot = self._own_version.index(version)
        else:
            t0 = time.perf_counter()
            slot = self._capture(version, named, meta())
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

    def _capture(self, version: int, named: list, meta: dict) -> int:
        if self.layout is None or not self.layout.matches(named):
            self._allocate(named)
        # Never overwrite the snapshot of the globally committed version: recovery may land there.
        g, held = self.global_committed, self._own_version
        if g != NO_VERSION and g in held:
            slot = 1 - held.index(g)
        else:
            slot = 0 if held[0] <= held[1] else 1
        self._own_version[slot] = NO_VERSION
        self.snapshots.begin(slot)
        if self._stream is None:
            for i, (view, (_, src)) in enumerate(zip(self._own_views[slot], named)):
                faults.hit("snapshot_write", i)
                view.copy_(src.reshape(-1))
            write_meta(self._own[slot], self.layout, meta)
            self.snapshots.seal(slot, version, self.generation)  # see retain.py: sealed on the training thread
        else:
            device = self.snapshots.device
            if device is not None:
                self.snapshots.device_begin()
            self._stream.wait_stream(self._acc.current_stream())  # after the step's kernels that wrote the state
            with self._acc.stream(self._stream):
                for i, (view, (_, src)) in enumerate(zip(self._own_views[slot], named)):
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
            write_meta(self._own[slot], self.layout, meta)  # host memory: the metadata is written now
        self._own_version[slot] = version
        return slot

    def before_update(self) -> None:
        """Call before anything changes the captured state (the optimizer step): on an
        accelerator, the device waits there until the last capture's copy has read it (the
        training thread does not wait). A no-op on CPU, where the capture is synchronous."""
        if self._fence is not None:
            self._acc.current_stream().wait_event(self._fence)

    def _copy_landed(self, slot: int) -> None:
        """Block until slot's device-to-host copy is in host memory (accelerator only)."""
        event = self._copied[slot]
        if event is not None:
            event.synchronize()
            self._copied[slot] = None

    def _allocate(self, named: list) -> None:
        if self.layout is not None:
            self.on_event("mirror_layout_changed", old_bytes=self.layout.nbytes)
            self.snapshots.close()
        layout = Layout.of(named)
        snapshots = self._make_snapshots(layout)
        self._adopt(layout, snapshots, snapshots.versions())

    def _adopt(self, layout: Layout, snapshots: Snapshots, versions: list[int]) -> None:
        self.layout, self.snapshots, self._cuts, self._device_views = layout, snapshots, None, None
        self._own = snapshots.buffers
        self._own_views = [layout.views(b) for b in self._own]
        self._own_version = list(versions)

    def hand_over(self, keep: int) -> Inherited | None:
        """After :meth:`stop` and the restore: this mirror's own buffers for the next generation's
        mirror, still holding every snapshot of ``keep`` (the version landed on) or older: those
        are of the timeline the job goes on with, and the one before ``keep`` is where a failure
        during the next generation's first round lands. A buffer of a later version is marked
        free (a retained one loses its records too). None when there are none, or when the
        background thread still runs (it could touch them); the buffers are then kept here."""
        if self.snapshots is None or self._thread.is_alive():
            return None
        versions = [v if v <= keep else NO_VERSION for v in self._own_version]
        for slot, v in enumerate(versions):
            if v == NO_VERSION:
                self.snapshots.begin(slot)
        out = Inherited(self.layout, self.snapshots, versions, self._copies_of(keep))
        self.layout, self.snapshots, self._own, self._own_views = None, None, [], []
        self._own_version = [NO_VERSION, NO_VERSION]
        return out

    def _copies_of(self, keep: int) -> dict[int, Copy]:
        """The full copies this rank holds of version ``keep`` or older, each source's newest as
        the committed copy and the one before it, if any, as the previous (a later version a
        survivor had committed is of a timeline the job just rolled back from: it must never be
        reported again, and its buffer is the one the next round writes)."""
        if self.stripe is not None:
            return {}
        out = {}
        for src, c in self.copies.items():
            if c.committed is not None and NO_VERSION != c.version <= keep:
                prev = c.previous_version if c.incoming is not None and c.previous_header is not None else NO_VERSION
                out[src] = Copy(committed=c.committed, incoming=c.incoming, version=c.version,
                                committed_header=c.committed_header, previous_version=prev,
                                previous_header=c.previous_header if prev != NO_VERSION else None)
            elif NO_VERSION != c.previous_version <= keep and c.incoming is not None and c.previous_header is not None:
                out[src] = Copy(committed=c.incoming, incoming=c.committed, version=c.previous_version,
                                committed_header=c.previous_header)
        return out

    def own_snapshot(self, version: int) -> torch.Tensor | None:
        """This rank's own snapshot of ``version``, if it still has it."""
        for slot in (0, 1):
            if self._own_version[slot] == version:
                return self._own[slot]
        return None

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
        return tuple(self._own_version)

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
        own = frozenset(v for v in self._own_version if v != NO_VERSION)
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
        held = {s: frozenset(v for v in (c.version, c.previous_version) if v != NO_VERSION)
                for s, c in self.copies.items()}
        return {s: vs for s, vs in held.items() if vs}

    def held_copy(self, source: int, version: int) -> tuple[Header, torch.Tensor]:
        """The copy of ``source`` at ``version`` (header, bytes), without a copy; call after :meth:`stop`."""
        copy = self.copies[source]
        if copy.committed is not None and copy.committed_header is not None and copy.version == version:
            return copy.committed_header, copy.committed
        if copy.incoming is not None and copy.previous_header is not None and copy.previous_version == version:
            return copy.previous_header, copy.incoming
        raise MirrorError(f"rank {self.rank} holds no copy of rank {source} at version {version} (it holds "
                          f"{sorted(v for v in (copy.version, copy.previous_version) if v != NO_VERSION)})")

    def stop(self, join_s: float = 0.2) -> bool:
        """Freeze what this rank holds (a failure happened): no copy commits after this returns.

        The background thread is told to stop; what it may still do changes nothing that
        :meth:`holdings` reports (commits and the invalidation of the previous copy check the
        stop flag under the commit lock), so the recovery need not wait for it. A round blocked
        in a transfer ends with the transfer's error or its timeout; :meth:`join` waits for that.
        Returns whether the thread ended within ``join_s``. Buffers stay, for the restore.
        """
        for slot in (0, 1):  # the restore reads this rank's own snapshots: their copies must have landed
            self._copy_landed(slot)
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
        for slot in (0, 1):  # no device-to-host copy may still be writing into a buffer let go of
            self._copy_landed(slot)
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
        buf = self._own[slot]
        if self._stream is not None:
            self._copy_landed(slot)
            self.snapshots.seal(slot, version, self.generation)  # only once its bytes are all there
        holders = [h for h in self.holders if h not in skip_to]
        pieces = self._checksums(buf) if holders or self.snapshots.chunk_bytes is not None else None
        if self.snapshots.chunk_bytes is not None:
            self.snapshots.commit(slot, version, pieces.grid(self.snapshots.chunk_bytes))
        sends = []
        if self.stripe is None:
            if holders:
                header = Header(self.generation, version, self.rank, buf.numel(), pieces.whole(), self.layout.id)
                first = self._first_out(0, header, buf)
                rest = self._rest(buf)
            for dst in holders:
                sends.append(self.transport.send(first, dst, TAG_HEADER))
                sends.extend(self.transport.send(chunk, dst, TAG_DATA) for chunk in rest)
            sent = buf.numel() * len(holders)
        else:
            sends, sent = self._send_shares(version, buf, pieces) if self.holders else ([], 0)
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
        if self._cuts is None or self._cuts[-1] != n:
            grids = [g for g in (self.snapshots.chunk_bytes,
                                 -(-n // self.stripe[0]) if self.stripe is not None else None) if g]
            self._cuts = checksum.cuts(n, *grids)
        return checksum.Pieces(buf.numpy(), self._cuts)

    def _send_shares(self, version: int, buf: torch.Tensor, pieces: checksum.Pieces) -> tuple[list, int]:
        """Encode ``buf`` into k+m zfec shares and send share j to the holder of share j (j >= 1);
        returns the send handles and the bytes sent.
        Data shares go out as views of ``buf`` (unchanged until the round ends); parity shares
        through buffers allocated once."""
        k, m = self.stripe
        if self._striper is None or self._striper.nbytes != buf.numel():
            self._striper = erasure.Striper(buf.numel(), k, m)
            self._share_out = [torch.zeros(self._striper.block, dtype=torch.uint8) for _ in range(m)]
        info, shares = self._striper.encode(buf.numpy(), pieces)
        sends, sent = [], 0
        for j, dst in enumerate(self.holders, start=1):
            if j < k:
                out = torch.from_numpy(shares[j])
            else:
                out = self._share_out[j - k]
                out.numpy()[:] = shares[j]
            header = Header(self.generation, version, self.rank, info.block, info.share_crcs[j], self.layout.id,
                            share=j, total_nbytes=info.nbytes, total_crc32=info.crc, k=k, m=m)
            sends.append(self.transport.send(self._first_out(j - 1, header, out), dst, TAG_HEADER))
            sends.extend(self.transport.send(chunk, dst, TAG_DATA) for chunk in self._rest(out))
            sent += out.numel()
        return sends, sent

    def _fused(self, nbytes: int) -> int:
        """Payload bytes that go in a transfer's first message, behind the header."""
        return min(nbytes, self.chunk_bytes, FUSED_BYTES)

    def _first_out(self, i: int, header: Header, payload: torch.Tensor) -> torch.Tensor:
        """First message ``i`` of this round (the header, then ``payload``'s first bytes)."""
        f = self._fused(payload.numel())
        while len(self._firsts_out) <= i:
            self._firsts_out.append(torch.zeros(0, dtype=torch.uint8))
        if self._firsts_out[i].numel() != HEADER_BYTES + f:
            self._firsts_out[i] = torch.zeros(HEADER_BYTES + f, dtype=torch.uint8)
        out = self._firsts_out[i]
        header.to_tensor(out[:HEADER_BYTES].view(torch.int64))
        out[HEADER_BYTES:].copy_(payload[:f])
        return out

    def _rest(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The payload after what the first message carries, in ``chunk_bytes`` pieces."""
        n = buf.numel()
        return [buf[i:i + self.chunk_bytes] for i in range(self._fused(n), n, self.chunk_bytes)]

    def _receive(self, src: int, version: int) -> None:
        copy = self.copies[src]
        if copy.first is None:  # big enough for any first message (a shorter one lands at its start)
            copy.first = torch.zeros(HEADER_BYTES + min(self.chunk_bytes, FUSED_BYTES), dtype=torch.uint8)
        self.transport.recv(copy.first, src, TAG_HEADER).wait(self.timeout_s)
        h = Header.from_tensor(copy.first[:HEADER_BYTES].view(torch.int64))
        if h.magic != MAGIC or h.source != src or h.generation != self.generation or h.version != version \
                or h.share != self._share_of.get(src, -1):
            raise MirrorError(f"rank {self.rank}: bad header from rank {src} (expected generation "
                              f"{self.generation} version {version} share {self._share_of.get(src, -1)}): {h}")
        with self._commit_lock:
            if self._stop.is_set():
                return  # frozen for a restore: what is held must stay as reported
            if copy.incoming is None or copy.incoming.numel() != h.nbytes:
                # Warm-up (or a layout change): the only allocation on this path.
                copy.incoming = torch.zeros(h.nbytes, dtype=torch.uint8)
                if copy.committed is not None and copy.committed.numel() != h.nbytes:
                    copy.committed, copy.version = None, NO_VERSION
            copy.previous_version, copy.previous_header = NO_VERSION, None  # its buffer is written now
        handles = [self.transport.recv(chunk, src, TAG_DATA) for chunk in self._rest(copy.incoming)]
        f = self._fused(h.nbytes)
        copy.incoming[:f].copy_(copy.first[HEADER_BYTES:HEADER_BYTES + f])
        for handle in handles:
            handle.wait(self.timeout_s)
        if crc32(copy.incoming) != h.crc32:
            self.stats.commit_failures += 1
            self.on_event("mirror_checksum_failed", source=src, version=version)
            return  # the committed copy stays as it was
        if copy.committed is None:
            copy.committed = torch.zeros_like(copy.incoming)
        with self._commit_lock:
            if self._stop.is_set():
                return  # frozen for a restore: what is held must not change
            copy.committed, copy.incoming = copy.incoming, copy.committed
            copy.previous_version, copy.previous_header = copy.version, copy.committed_header
            copy.version = h.version
            copy.committed_header = h
        self.on_event("mirror_commit", source=src, version=version)
