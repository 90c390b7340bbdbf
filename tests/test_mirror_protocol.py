"""Mirror protocol with threads (one per rank) over LocalTransport: versions commit only when
complete and checksummed, every committed copy equals the source's state bitwise, an
interrupted transfer never commits, the in-flight policy counts waits and skips, and threads
end on close. Pure Python + torch; no process group."""
from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from hotspare.mirror import NO_VERSION, Mirror, MirrorError
from hotspare.wire import HEADER_BYTES, TAG_DATA, TAG_HEADER
from hotspare.placement import place
from hotspare.snapshot import Header, Layout, read_meta
from hotspare.transport import LocalFabric, TransferError


class ThreadAllReduceMin:
    """A MIN all-reduce among n threads (what the control group does between processes)."""

    def __init__(self, n: int, timeout_s: float = 10.0):
        self.n, self.timeout_s = n, timeout_s
        self.values: list[torch.Tensor] = []
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(n, timeout=timeout_s)
        self.result = None

    def __call__(self, t: torch.Tensor) -> None:
        with self.lock:
            self.values.append(t.clone())
        if self.barrier.wait() == 0:
            self.result = torch.stack(self.values).min(dim=0).values
            self.values = []
        self.barrier.wait()
        t.copy_(self.result)
        self.barrier.wait()


def make_state(rank: int, version: int, numel: int = 5000):
    g = torch.Generator().manual_seed(rank * 1000 + version)
    return [("fp32.0", torch.randn(numel, generator=g)), ("optim.0.exp_avg", torch.randn(numel // 2, generator=g)),
            ("optim.0.step", torch.tensor([float(version)])), ("rng.torch", torch.get_rng_state())]


def digest(named) -> str:
    h = hashlib.sha256()
    for _, t in named:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def committed(mirror: Mirror, src: int):
    """(version, digest of the tensor segments, metadata) of the copy of ``src`` that ``mirror`` holds."""
    version, buf = mirror.read_committed(src)
    layout = mirror.layout  # all ranks have the same layout in these tests
    dig = hashlib.sha256(b"".join(v.contiguous().view(torch.uint8).numpy().tobytes()
                                  for v in layout.views(buf))).hexdigest()
    return version, dig, read_meta(buf, layout)


def committed_digest(mirror: Mirror, src: int) -> str:
    return committed(mirror, src)[1]


def run_ranks(n, fn, timeout_s=30):
    errors, threads = [], []

    def wrap(rank):
        try:
            fn(rank)
        except BaseException as exc:  # noqa: BLE001
            errors.append((rank, exc))

    for r in range(n):
        threads.append(threading.Thread(target=wrap, args=(r,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a rank thread hung"
    if errors:
        raise errors[0][1]


def build(n=4, replicas=1, **kwargs):
    fabric = LocalFabric()
    holders = place([r * 2 // n for r in range(n)], replicas)
    control = ThreadAllReduceMin(n)
    mirrors = [Mirror(r, 0, holders, fabric.endpoint(r), control, timeout_s=5, **kwargs) for r in range(n)]
    return fabric, holders, mirrors


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 1000])
def test_every_committed_copy_equals_the_source_bitwise(chunk_bytes):
    fabric, holders, mirrors = build(chunk_bytes=chunk_bytes)
    truth = {}  # (rank, version) -> digest of the live state at capture
    seen = []

    def rank_loop(r):
        m = mirrors[r]
        for v in range(1, 8):
            state = make_state(r, v)
            truth[(r, v)] = digest(state)
            m.on_step(v, lambda: state, lambda: {"v": v, "rank": r})
            for src in m.copies:
                if m.read_committed(src)[0] != NO_VERSION:
                    seen.append((src, *committed(m, src)))
        m.flush()

    try:
        run_ranks(4, rank_loop)
        assert seen
        for src, version, dig, meta in seen:
            assert dig == truth[(src, version)], f"copy of rank {src} v{version} differs from its source"
            assert meta == {"v": version, "rank": src}
        for m in mirrors:
            assert m.global_committed == 7
            assert all(c.version == 7 for c in m.copies.values())
            assert m.stats.rounds == 7 and m.stats.bytes_sent == 7 * m.layout.nbytes
        # Holders are the placement's: rank r's copy lives exactly at holders[r].
        for src, hs in holders.items():
            assert [m.rank for m in mirrors if src in m.copies] == hs
    finally:
        for m in mirrors:
            m.close()


def test_interrupted_transfer_never_commits_and_keeps_the_previous_version():
    fabric, holders, mirrors = build(n=2, chunk_bytes=1000)
    m0, m1 = mirrors
    state_v1, state_v2 = make_state(0, 1), make_state(0, 2)

    def rank_loop(r):
        m = mirrors[r]
        m.on_step(1, (lambda: state_v1) if r == 0 else (lambda: make_state(1, 1)), dict)
        m.flush()

    run_ranks(2, rank_loop)
    assert m1.copies[0].version == 1
    before = committed_digest(m1, 0)
    assert before == digest(state_v1)

    # Rank 0 dies after sending a few chunks of version 2.
    sent = {"n": 0}
    real_send = m0.transport.send

    def dying_send(tensor, dst, tag):
        sent["n"] += 1
        if sent["n"] == 4:
            fabric.cut(0)
        return real_send(tensor, dst, tag)

    m0.transport.send = dying_send

    def rank_loop2(r):
        mirrors[r].on_step(2, (lambda: state_v2) if r == 0 else (lambda: make_state(1, 2)), dict)
        with pytest.raises(MirrorError):
            mirrors[r].flush(timeout_s=10)

    try:
        run_ranks(2, rank_loop2)
        assert m1.copies[0].version == 1, "a partial transfer became committed"
        assert committed_digest(m1, 0) == before, "the previous committed copy was touched"
        assert m0.own_snapshot(1) is not None  # the sender keeps its last globally committed snapshot
    finally:
        for m in mirrors:
            m.close()


def test_corrupted_bytes_fail_the_checksum_and_are_never_committed():
    fabric, holders, mirrors = build(n=2)
    m0, m1 = mirrors
    recv, receiving = m1.transport.recv, []

    def corrupting_recv(tensor, src, tag):
        handle = recv(tensor, src, tag)

        class Flip:
            def wait(self, timeout_s):
                handle.wait(timeout_s)
                if tag == TAG_HEADER:  # a snapshot's first message: which version this is
                    receiving[:] = [Header.from_tensor(tensor[:HEADER_BYTES].view(torch.int64)).version]
                if receiving == [2]:
                    # Flip a byte after it lands but before the check: what a bad link or bit flip does.
                    at = 100 + (HEADER_BYTES if tag == TAG_HEADER else 0)  # a payload byte
                    if tensor.numel() > at:
                        tensor[at] ^= 0xFF
        return Flip()

    m1.transport.recv = corrupting_recv

    def loop(r):
        for v in (1, 2, 3):
            st = make_state(r, v)
            mirrors[r].on_step(v, lambda: st, dict)
            mirrors[r].flush()
            if v == 2:
                assert mirrors[r].global_committed == 1

    try:
        run_ranks(2, loop)
        assert m1.stats.commit_failures == 1 and m1.copies[0].version == 3
        assert committed_digest(m1, 0) == digest(make_state(0, 3))
    finally:
        for m in mirrors:
            m.close()


@pytest.mark.parametrize("policy", ["wait", "skip"])
def test_in_flight_policy_is_counted(policy):
    """Rank 1 holds back its round 1 (and, waiting, its round 2): 'wait' makes steps 2 and 3
    wait on every rank, 'skip' skips step 2 on every rank. A round is released from what the
    ranks do, not after a time: once every rank's next step waits for it ('wait'), or before
    step 3 ('skip')."""
    fabric, holders, mirrors = build(n=2, in_flight=policy)
    gates = {1: threading.Event(), 2: threading.Event()} if policy == "wait" else {1: threading.Event()}
    send = mirrors[1].transport.send

    def slow_send(tensor, dst, tag):
        if tag == TAG_HEADER:
            gate = gates.get(Header.from_tensor(tensor[:HEADER_BYTES].view(torch.int64)).version)
            if gate is not None:
                gate.wait(5)  # the round is still in flight when the next step ends
        return send(tensor, dst, tag)

    mirrors[1].transport.send = slow_send
    if policy == "wait":
        # A rank's n-th wait is step n+1's (the flush at the end comes after step 3): round n is
        # released once every rank's n-th wait began (the mirror says so before it waits).
        waits, lock = {m.rank: 0 for m in mirrors}, threading.Lock()
        for m in mirrors:
            def waiting(kind, m=m, **fields):
                if kind != "mirror_waiting":
                    return
                with lock:
                    waits[m.rank] += 1
                    if min(waits.values()) in gates:
                        gates[min(waits.values())].set()
            m.on_event = waiting

    def loop(r):
        for v in (1, 2, 3):
            st = make_state(r, v)
            if v == 3 and policy == "skip":
                gates[1].set()  # round 1 lands before step 3: step 2, and only it, was skipped
                mirrors[r].flush()
            mirrors[r].on_step(v, lambda: st, dict)
        mirrors[r].flush()

    try:
        run_ranks(2, loop)
        for m in mirrors:
            if policy == "wait":
                assert m.stats.waits == 2 and m.stats.skips == 0 and m.stats.rounds == 3
            else:
                assert m.stats.waits == 0 and m.stats.skips == 1 and m.stats.rounds == 2
            assert m.global_committed == max(m.own_versions) == 3
        # Both ranks made the same decision: the same versions were sent everywhere.
        assert mirrors[0].stats.skips == mirrors[1].stats.skips
        assert mirrors[0].stats.waits == mirrors[1].stats.waits
    finally:
        for m in mirrors:
            m.close()


def test_close_ends_the_thread():
    _, _, mirrors = build(n=2)
    for m in mirrors:
        m.close()
    assert not any(t.name.startswith("hotspare-mirror") for t in threading.enumerate())


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 1000])
def test_a_transfer_is_one_first_message_then_chunks_and_survives_size_changes(chunk_bytes):
    """A copy that fits in a chunk travels as one message (header + bytes); a bigger one as that
    first message and the rest in chunks. The receiver posts its first receive before it knows
    the size, so the state growing and shrinking within a generation must still commit bitwise."""
    fabric, holders, mirrors = build(n=2, chunk_bytes=chunk_bytes)
    sent = {0: [], 1: []}
    for m in mirrors:
        real = m.transport.send

        def counting(tensor, dst, tag, real=real, r=m.rank):
            sent[r].append((tag, tensor.numel()))
            return real(tensor, dst, tag)
        m.transport.send = counting
    sizes = {1: 5000, 2: 5000, 3: 20000, 4: 300, 5: 5000}

    def loop(r):
        for v, numel in sizes.items():
            st = make_state(r, v, numel)
            mirrors[r].on_step(v, lambda: st, dict)
            mirrors[r].flush()
            version, buf = mirrors[1 - r].read_committed(r)
            views = Layout.of(st).views(buf)  # the source's layout of v (the holder's own may differ by now)
            assert version == v and [t.view(torch.uint8).tolist() for t in views] == \
                [t.reshape(-1).view(torch.uint8).tolist() for _, t in st], (r, v)

    try:
        run_ranks(2, loop)
        layouts = [Layout.of(make_state(0, v, n)).nbytes for v, n in sizes.items()]
        expected = []
        for nbytes in layouts:
            first = min(nbytes, chunk_bytes)
            expected.append((TAG_HEADER, HEADER_BYTES + first))
            expected += [(TAG_DATA, min(chunk_bytes, nbytes - lo)) for lo in range(first, nbytes, chunk_bytes)]
        assert sent[0] == expected
        assert mirrors[1].stats.commit_failures == 0
    finally:
        for m in mirrors:
            m.close()


def test_local_transport_lands_a_short_message_at_the_start_and_refuses_a_long_one():
    """LocalTransport behaves as gloo does (tests/test_mirror_kill.py pins gloo)."""
    fabric = LocalFabric()
    a, b = fabric.endpoint(0), fabric.endpoint(1)
    landing = torch.full((10,), 7, dtype=torch.uint8)
    send = a.send(torch.arange(4, dtype=torch.uint8), 1, 3)
    b.recv(landing, 0, 3).wait(5)
    send.wait(5)
    assert landing.tolist() == [0, 1, 2, 3, 7, 7, 7, 7, 7, 7]
    send = a.send(torch.arange(11, dtype=torch.uint8), 1, 3)
    with pytest.raises(TransferError, match="11 bytes 0->1 tag 3 do not fit the 10 bytes posted"):
        b.recv(landing, 0, 3).wait(5)
    with pytest.raises(TransferError, match="do not fit"):
        send.wait(5)


def test_layout_is_aligned_and_stable():
    named = make_state(0, 1)
    layout = Layout.of(named)
    assert all(s.offset % 64 == 0 for s in layout.segments)
    assert Layout.of(make_state(3, 9)).id == layout.id and layout.matches(make_state(2, 2))
    assert Layout.of(make_state(0, 1, numel=10)).id != layout.id


def test_the_copy_before_the_committed_one_stays_until_a_round_writes_over_it():
    """Two ranks that die together may have their copies at different versions (G and G+1): the
    holder of the one at G+1 must still have G. It does, until the next round starts to write."""
    fabric, holders, mirrors = build(n=2, chunk_bytes=1000)
    m0, m1 = mirrors
    states = {(r, v): make_state(r, v) for r in (0, 1) for v in (1, 2, 3)}

    def rank_loop(r):
        for v in (1, 2, 3):
            mirrors[r].on_step(v, lambda: states[(r, v)], dict)
        mirrors[r].flush()

    def held_digest(m, src, v):
        header, buf = m.held_copy(src, v)
        assert header.version == v
        return hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes()
                                       for t in m.layout.views(buf))).hexdigest()

    try:
        run_ranks(2, rank_loop)
        for m in mirrors:
            m.stop()
        assert m1.holdings()[1] == {0: frozenset({2, 3})}
        assert held_digest(m1, 0, 2) == digest(states[(0, 2)])
        assert held_digest(m1, 0, 3) == digest(states[(0, 3)])
        with pytest.raises(MirrorError, match="holds no copy of rank 0 at version 1 \\(it holds \\[2, 3\\]\\)"):
            m1.held_copy(0, 1)
    finally:
        for m in mirrors:
            m.close()

    # A round that started writing into the spare buffer invalidates the version it held: rank 0
    # is cut off just as rank 1 posts its first receive of version 3's bytes.
    fabric, holders, mirrors = build(n=2, chunk_bytes=1000)
    m0, m1 = mirrors
    real_recv = m1.transport.recv

    def rank_loop2(r):
        for v in (1, 2):
            mirrors[r].on_step(v, lambda: make_state(r, v), dict)
        mirrors[r].flush()
        if r == 1:
            def recv_then_cut(tensor, src, tag):
                if tag == TAG_DATA:
                    fabric.cut(0)
                return real_recv(tensor, src, tag)

            m1.transport.recv = recv_then_cut
        mirrors[r].on_step(3, lambda: make_state(r, 3), dict)
        with pytest.raises(MirrorError):
            mirrors[r].flush(timeout_s=10)

    try:
        run_ranks(2, rank_loop2)
        m1.stop()
        assert m1.holdings()[1] == {0: frozenset({2})}
    finally:
        for m in mirrors:
            m.close()


@pytest.mark.parametrize("k,m,n", [(2, 1, 3), (2, 2, 4), (3, 1, 4)])
def test_a_stripe_round_leaves_shares_that_rebuild_every_source_without_its_node(k, m, n):
    """Tier 2 stripe: after each round the holders of rank r's shares (r's own node excluded)
    hold enough committed shares of the newest version to rebuild r's snapshot bitwise."""
    from hotspare import erasure

    fabric = LocalFabric()
    holders = erasure.place_shares(list(range(n)), k, m)  # one rank per node
    control = ThreadAllReduceMin(n)
    mirrors = [Mirror(r, 0, holders, fabric.endpoint(r), control, timeout_s=5, stripe=(k, m), chunk_bytes=999)
               for r in range(n)]
    own = {}

    def rank_loop(r):
        for v in range(1, 4):
            state = make_state(r, v, numel=1001)  # k rarely divides the snapshot: padding is exercised
            mirrors[r].on_step(v, lambda: state, lambda: {"v": v})
        mirrors[r].flush()
        own[r] = mirrors[r].own_snapshot(3).clone()

    try:
        run_ranks(n, rank_loop)
        for src in range(n):
            assert mirrors[src].holdings()[1] == {}  # no full copies with a stripe
            held = {j: mirrors[h] for j, h in enumerate(holders[src]) if h != src}
            assert all(3 in hm.share_holdings()[src] for hm in held.values())
            headers = {j: hm.held_copy(src, 3) for j, hm in held.items()}
            first = next(iter(headers.values()))[0]
            crcs = [0] * (k + m)
            for j, (h, _) in headers.items():
                assert h.share == j
                crcs[j] = h.crc32
            info = erasure.StripeInfo(k, m, first.total_nbytes, first.nbytes, tuple(crcs), first.total_crc32)
            data = erasure.decode(info, {j: buf.numpy() for j, (_, buf) in headers.items()})
            assert data == own[src].numpy().tobytes(), f"rank {src}'s snapshot does not decode bitwise"
            ratio = sum(mm.tier2_bytes() for mm in mirrors) / sum(mm.layout.nbytes for mm in mirrors)
            assert abs(ratio - (k + m) / k) < 0.01, ratio
    finally:
        for mm in mirrors:
            mm.close()


def _rounds(mirrors, r, versions):
    for v in versions:
        state = make_state(r, v)
        mirrors[r].on_step(v, lambda: state, lambda: {"v": v})
    mirrors[r].flush()


def _next_generation(old, holders, keep):
    """Stop ``old`` (a failure), hand its buffers over at ``keep``, and make generation 1's mirrors."""
    for m in old:
        m.join(10)
        m.stop()
    inherited = [m.hand_over(keep) for m in old]
    fabric = LocalFabric()
    control = ThreadAllReduceMin(len(old))
    return fabric, [Mirror(r, 1, holders, fabric.endpoint(r), control, timeout_s=5, inherit=inherited[r])
                    for r in range(len(old))]


def test_the_next_generation_keeps_the_landing_version_and_the_one_before_and_resends_neither():
    """After a recovery lands on version V, each rank's own snapshots and each holder's copies of
    V and older go over to the new mirror; a copy of a later version, from the timeline the job
    rolled back from, does not. The first round (Mirror.seed) goes out from the inherited
    snapshot of V and moves nothing to a holder that holds V already, so V-1 stays everywhere."""
    _, holders, mirrors = build(n=2)
    run_ranks(2, lambda r: _rounds(mirrors, r, range(1, 4)))  # copies of 3 committed, 2 the previous
    digests = [committed_digest(m, s) for m in mirrors for s in m.sources]
    own3 = [m.own_snapshot(3).clone() for m in mirrors]
    _, new = _next_generation(mirrors, holders, keep=3)
    try:
        assert [m.holdings() for m in new] == [(frozenset({2, 3}), {1 - r: frozenset({2, 3})}) for r in range(2)]
        assert [committed_digest(m, s) for m in new for s in m.sources] == digests

        def first_round(r):
            state = make_state(r, 3)
            new[r].seed(3, lambda: state, lambda: {"v": 3}, held_by=[1 - r], held_from=[1 - r])
            new[r].flush()

        run_ranks(2, first_round)
        assert [m.stats.bytes_sent for m in new] == [0, 0] and all(m.global_committed == 3 for m in new)
        assert [m.holdings() for m in new] == [(frozenset({2, 3}), {1 - r: frozenset({2, 3})}) for r in range(2)]
        assert all(torch.equal(m.own_snapshot(3), o) for m, o in zip(new, own3))  # no capture over it
        run_ranks(2, lambda r: _rounds(new, r, [4]))  # the next round writes over 2, not over 3
        assert [m.holdings() for m in new] == [(frozenset({3, 4}), {1 - r: frozenset({3, 4})}) for r in range(2)]
    finally:
        for m in new:
            m.close()
    # A holder that had committed version 4 (rolled back from) hands over only 3, from its previous copy.
    _, holders, mirrors = build(n=2)
    run_ranks(2, lambda r: _rounds(mirrors, r, range(1, 5)))
    for m in mirrors:
        m.stop()
    inherited = mirrors[0].hand_over(3)
    assert {s: (c.version, c.previous_version) for s, c in inherited.copies.items()} == {1: (3, NO_VERSION)}
    assert sorted(inherited.versions) == [NO_VERSION, 3]
    for m in mirrors:
        m.close()


def test_a_failure_during_the_first_round_after_a_recovery_finds_the_version_before():
    """The window a recovery leaves open: it landed on V, which some rank holds only itself (a
    survivor's own snapshot, or a spare's node keeper), and that rank's node is lost before the
    new generation's first round has put V on another node. The holders still hold V-1 of every
    rank, and every survivor its own V-1, so the job lands there instead of stopping."""
    from hotspare.planning import SELF, Holdings, choose_version

    fabric, holders, mirrors = build(n=2)
    run_ranks(2, lambda r: _rounds(mirrors, r, range(1, 3)))
    fabric.cut(1)  # rank 1 dies as round 3 starts: 3 is in the ranks' own snapshots only
    for r, m in enumerate(mirrors):
        state = make_state(r, 3)
        m.on_step(3, lambda: state, lambda: {"v": 3})
    lost_2 = mirrors[1].own_snapshot(2).clone()
    fabric, new = _next_generation(mirrors, holders, keep=3)
    try:
        assert new[0].holdings() == (frozenset({2, 3}), {1: frozenset({1, 2})})
        state = make_state(0, 3)
        new[0].seed(3, lambda: state, lambda: {"v": 3})  # rank 0 holds no copy of 3: a full round
        fabric.cut(1)  # rank 1's node is lost before its 3 reached rank 0
        assert new[0].settle(10) and new[0].error is not None
        new[0].stop()
        own, held = new[0].holdings()
        plan = choose_version([Holdings(own=own, held=held), Holdings()], new_ranks=[1])
        assert plan.version == 2 and plan.sources == {0: (SELF,), 1: (0,)}
        assert torch.equal(new[0].held_copy(1, 2)[1], lost_2)
    finally:
        for m in new:
            m.close()


def test_settle_waits_for_the_round_is_bounded_and_leaves_its_error_for_the_next_step():
    """What a recovery's wait for its first round (session.landing.Landing, phase protect_s) relies on."""
    fabric, holders, mirrors = build(n=2, chunk_bytes=1000)
    m0, m1 = mirrors
    try:
        run_ranks(2, lambda r: mirrors[r].on_step(1, lambda: make_state(r, 1), dict))
        assert m0.settle(5) and m1.settle(5)  # no agreement of its own: just the round's end
        assert m1.copies[0].version == 1 and m0.copies[1].version == 1 and m0.error is None

        # Rank 0 is alive but does not take part in round 2: the wait gives up at its bound.
        m1.on_step(2, lambda: make_state(1, 2), dict)
        assert not m1.settle(0.2)
        # Then rank 0 dies: the round fails, the wait returns, the error waits for the next step.
        fabric.cut(0)
        assert m1.settle(10) and m1.error is not None
        with pytest.raises(MirrorError, match="mirroring stopped"):
            m1.on_step(3, lambda: make_state(1, 3), dict)
        assert m1.copies[0].version == 1  # nothing of the failed round committed
    finally:
        for m in mirrors:
            m.close()
