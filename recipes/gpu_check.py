"""The checks of hotspare's accelerator paths that need a GPU, in one run (one GPU is enough):
writes one JSON object and prints it. CI never runs this (it has no GPU); run it where one is:

    python recipes/gpu_check.py --out gpu_check.json [--mb 1024]

- ``mirror``: two mirrors in threads (in-process transport) capture CUDA state into pinned host
  snapshots and mirror it; the holder's committed copy must equal the source bitwise. Reports
  how long the training thread was held per capture (``capture_ms``) against the D2H copy time
  alone, pinned and pageable, and the copy rate.
- ``deepspeed``: a ZeRO engine (stages 2 and 3) on the GPU (NCCL, world size 1): the unique
  state is captured, one step run, the state restored and resynced, the step run again: the
  loss and the fp32 partitions must be bitwise the same both times (restore and resync on CUDA
  tensors, the CUDA RNG state included).
- ``megatron``: the same round trip for a megatron-core GPTModel with the distributed optimizer
  (no CPU shim: it does nothing where CUDA is available).
- ``nccl``: the rank agreement (``rebuild.check_same``) on the NCCL default group, then
  ``hotspare.sockets.abort_nccl`` aborts a subgroup and WORLD, the rebuild's walk still finds
  both (their ranks), and a new generation's group is made on a new store prefix in the same
  process (the in-place rebuild on NCCL).
- ``cuda_ipc``: what a keeper's GPU tier would rest on: a keeper-like process allocates device
  memory and exports its IPC handle; a trainer process maps it, writes state, and is SIGKILLed;
  a spare process maps the same handle and reads the state back bitwise. Reports the
  device-to-device rate into the mapped memory.
- ``keeper_pinned``: the mirror's snapshots in a keeper's shared-memory segment, page-locked in
  place (``cudaHostRegister``): the capture stays asynchronous, the copy bitwise.
- ``keeper_device``: the keeper's GPU tier (``retain.device_tier``): a keeper process holds a
  rank's device copy, its trainer is SIGKILLed, a spare restores from the device copy bitwise;
  restore time from the device copy against from the host segment.
"""
from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback


def section(results: dict, name: str):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            results[name] = {"ok": True, **fn()}
        except Exception as exc:  # noqa: BLE001 - every check reports, none stops the others
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = time.perf_counter() - t0
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED ' + results[name]['error']}", flush=True)
        return fn
    return wrap


def sha(t) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(__import__("torch").uint8).cpu().numpy()
                          .tobytes()).hexdigest()


def _two_mirrors(pinned: bool, snapshots=(None, None)):
    import torch

    from hotspare.mirror import Mirror
    from hotspare.transport import LocalFabric

    fabric = LocalFabric()
    barrier = threading.Barrier(2)
    vals, lock = {}, threading.Lock()

    def agree_for(rank):
        def agree(t):
            with lock:
                vals[rank] = t.clone()
            barrier.wait()
            t.copy_(torch.minimum(vals[0], vals[1]))
            barrier.wait()
        return agree

    return [Mirror(r, 0, {0: [1], 1: [0]}, fabric.endpoint(r), agree_for(r), chunk_bytes=64 << 20, timeout_s=120,
                   pin_memory=pinned, snapshots=snapshots[r]) for r in range(2)]


def _run_ranks(fn) -> None:
    errors = []

    def wrap(r):
        try:
            fn(r)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]


def check_mirror(mb: int) -> dict:
    """Correctness of the asynchronous capture (the state changes right after each capture, behind
    before_update's fence), then the training thread's time per capture against the copy alone."""
    import torch

    out = {}
    # Correctness: every version's committed copy equals the state as it was at its capture.
    numel = max(1, mb // 8) * (1 << 20) // 4
    mirrors = _two_mirrors(True)
    states = [[("fp32.0", torch.randn(numel, device="cuda")), ("optim.0.exp_avg", torch.randn(numel, device="cuda"))]
              for _ in range(2)]
    expected = [{}, {}]

    def loop(r):
        m = mirrors[r]
        for v in range(1, 6):
            with torch.no_grad():
                m.before_update()
                for _, t in states[r]:
                    t.add_(1.0)  # the optimizer step: must not land in the previous version's copy
                expected[r][v] = [sha(t) for _, t in states[r]]
            m.on_step(v, lambda: states[r], lambda: {"v": v})
        m.flush()

    _run_ranks(loop)
    version, buf = mirrors[0].read_committed(1)
    held = [sha(x) for x in mirrors[0].layout.views(buf)[:2]]
    out["async_bitwise"] = held == expected[1][version]
    out["async_version"] = version
    for m in mirrors:
        m.close()
    if not out["async_bitwise"]:
        raise AssertionError(f"the asynchronously captured copy of version {version} differs from the state")
    # Time held on the training thread per capture, pinned (asynchronous) and pageable (synchronous).
    numel = mb * (1 << 20) // 4
    for pinned in (True, False):
        mirrors = _two_mirrors(pinned)
        states = [[("fp32.0", torch.randn(numel, device="cuda"))] for _ in range(2)]

        held = [[], []]

        def timed(r):
            m = mirrors[r]
            for v in range(1, 8):
                with torch.no_grad():
                    m.before_update()
                    states[r][0][1].mul_(1.0)
                before = m.stats.capture_s
                m.on_step(v, lambda: states[r], lambda: {"v": v})
                held[r].append(m.stats.capture_s - before)  # the first one allocates the snapshot buffers
            m.flush()

        _run_ranks(timed)
        m0 = mirrors[0]
        dst = torch.zeros(numel, pin_memory=pinned)  # touched: no first-use page faults in the timing
        copies = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(states[0][0][1], non_blocking=pinned)
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - t0)
        copy_s = sorted(copies)[1]
        steady = sorted(held[0][1:])
        out["pinned" if pinned else "pageable"] = {
            "bytes": m0.layout.nbytes, "capture_ms": 1e3 * steady[len(steady) // 2],
            "first_capture_ms": 1e3 * held[0][0],
            "d2h_copy_ms": 1e3 * copy_s, "d2h_gb_per_s": numel * 4 / copy_s / 1e9,
            "round_ms": 1e3 * m0.stats.round_s / m0.stats.rounds, "rounds": m0.stats.rounds}
        for m in mirrors:
            m.close()
    return out


def init_nccl(path: str):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = dist.FileStore(path, 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return store


def check_deepspeed(tmp: str) -> dict:
    """Each ZeRO stage in a process of its own (DeepSpeed keeps its groups in module globals)."""
    out = {}
    for stage in (2, 3):
        proc = subprocess.run([sys.executable, __file__, "--out", os.path.join(tmp, f"ds{stage}.json"), "--only",
                               "deepspeed_stage", "--stage", str(stage)], capture_output=True, text=True, timeout=240)
        result = json.load(open(os.path.join(tmp, f"ds{stage}.json")))["deepspeed_stage"]
        if not result["ok"]:
            raise AssertionError(f"ZeRO-{stage}: {result['error']}\n{result.get('traceback', '')}{proc.stderr[-800:]}")
        out[f"zero{stage}"] = result
    return out


def check_deepspeed_stage(tmp: str, stage: int) -> dict:
    import torch
    import torch.distributed as dist

    import hotspare
    from hotspare.integrations.deepspeed import DeepSpeedState, fp32_partitions
    from hotspare.snapshot import Layout, write_meta
    from hotspare.testing.gpt import GPT, GPTConfig

    out = {}
    for stage in (stage,):
        init_nccl(os.path.join(tmp, f"ds{stage}"))
        try:
            torch.manual_seed(0)
            model = GPT(GPTConfig(num_layers=2, hidden_size=256, num_heads=4, seq_len=64, dropout=0.1))
            ds = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
                  # DeepSpeed's default AdamW: FusedAdam on CUDA (int step per partition, stateless kernel).
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage}}
            session = hotspare.initialize(model=model, config=ds, model_parameters=model.parameters())
            engine = session.engine
            state = DeepSpeedState(engine)
            g = torch.Generator().manual_seed(1)
            batches = [torch.randint(0, 256, (4, 64), generator=g).cuda() for _ in range(3)]

            def step(tokens):
                loss = engine(tokens, tokens)
                engine.backward(loss)
                engine.step()
                return float(loss)

            step(batches[0])  # Adam's state exists from here on
            named = state.tensors()
            layout = Layout.of(named)
            buf = layout.allocate(pin=True)
            for view, (_, t) in zip(layout.views(buf), named):
                view.copy_(t.reshape(-1))
            write_meta(buf, layout, state.meta())
            first = step(batches[1])
            after_first = [sha(p) for p in fp32_partitions(engine)]
            state.restore(buf, layout)
            state.resync()
            second = step(batches[1])
            after_second = [sha(p) for p in fp32_partitions(engine)]
            out[f"zero{stage}"] = {"optimizer": type(engine.optimizer.optimizer).__name__,
                                   "loss_bitwise": first == second, "fp32_bitwise": after_first == after_second,
                                   "unique_bytes": layout.nbytes, "device": str(fp32_partitions(engine)[0].device)}
            if not (first == second and after_first == after_second):
                raise AssertionError(f"ZeRO-{stage}: the restored step differs ({first} vs {second})")
            session.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return out


def check_megatron(tmp: str) -> dict:
    import torch
    import torch.distributed as dist

    from hotspare.integrations.megatron import MegatronState
    from hotspare.snapshot import Layout, write_meta
    from hotspare.testing import mcore_gpt, statedigest
    from hotspare.testing.gpt import GPTConfig

    init_nccl(os.path.join(tmp, "mcore"))
    try:
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        cfg = GPTConfig(num_layers=2, hidden_size=128, num_heads=4, seq_len=32, dropout=0.1, vocab_size=256)
        t = mcore_gpt.MegatronTrain(micro_batch=2, microbatches=2, lr=1e-3, warmup_steps=1, decay_steps=10)
        model, opt, sched = mcore_gpt.build(cfg, t)
        state = MegatronState(model, opt, sched)

        def batches(it):
            for mb in range(t.microbatches):
                g = torch.Generator().manual_seed(it * 10 + mb)
                tok = torch.randint(0, cfg.vocab_size, (t.micro_batch, cfg.seq_len + 1), generator=g).cuda()
                yield tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

        mcore_gpt.train_iteration(model, opt, sched, batches(0), t, cfg.seq_len)
        state.iteration = 1
        named = state.tensors()
        layout = Layout.of(named)
        buf = layout.allocate(pin=True)
        for view, (_, x) in zip(layout.views(buf), named):
            view.copy_(x.reshape(-1))
        write_meta(buf, layout, state.meta())
        first = mcore_gpt.train_iteration(model, opt, sched, batches(1), t, cfg.seq_len)
        d1 = statedigest.megatron(model, opt, sched)
        state.restore(buf, layout)
        state.resync()
        second = mcore_gpt.train_iteration(model, opt, sched, batches(1), t, cfg.seq_len)
        d2 = statedigest.megatron(model, opt, sched)
        if first != second or statedigest.differences(d1, d2):
            raise AssertionError(f"the restored iteration differs: loss {first} vs {second}, "
                                 f"state parts {statedigest.differences(d1, d2)}")
        return {"loss_bitwise": True, "state_bitwise": True, "unique_bytes": layout.nbytes,
                "has_cuda_rng": any(n == "rng.cuda" for n, _ in named)}
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def check_nccl(tmp: str) -> dict:
    import torch
    import torch.distributed as dist

    from hotspare.rebuild import check_same, find_groups
    from hotspare.sockets import abort_nccl

    store = init_nccl(os.path.join(tmp, "abort"))
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    sub = dist.new_group([0])
    dist.all_reduce(x, group=sub)
    torch.cuda.synchronize()
    # The rank agreement of a recovery runs on the default (NCCL) group: device tensors only.
    check_same("layout", "the check's own text")
    group = dist.group.WORLD
    has_abort = hasattr(dist.distributed_c10d, "_abort_process_group")
    t0 = time.perf_counter()
    abort_nccl([sub, group])
    abort_s = time.perf_counter() - t0
    # What a survivor's recovery does next: walk its objects for the groups (their ranks).
    found = find_groups([{"sub": sub, "world": group}])
    if len(found) != 2:
        raise AssertionError(f"the rebuild's walk found {len(found)} of the 2 aborted groups")
    try:
        dist.destroy_process_group(sub)
    except Exception:  # noqa: BLE001 - an aborted group may refuse a clean destroy
        pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - an aborted group may refuse a clean destroy
        pass
    # The next generation on the same store, under its own prefix.
    dist.init_process_group("nccl", store=dist.PrefixStore("gen/1/", store), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    y = torch.full((4,), 2.0, device="cuda")
    dist.all_reduce(y)
    ok = float(y.sum()) == 8.0
    dist.destroy_process_group()
    if not ok:
        raise AssertionError("the new generation's all-reduce is wrong")
    return {"abort_available": has_abort, "abort_s": abort_s, "aborted_groups_found": len(found),
            "agreement_on_nccl": True, "new_generation_all_reduce": ok,
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


IPC_CHILD = r"""
import base64, json, os, sys, signal, time, torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
w = json.loads(sys.stdin.readline())
b = lambda x: None if x is None else base64.b64decode(x)
t = rebuild_cuda_tensor(torch.Tensor, torch.Size(w["size"]), tuple(w["stride"]), w["offset"], torch.UntypedStorage,
                        torch.uint8, w["device"], b(w["handle"]), w["storage_size"], w["storage_offset"], False,
                        b(w["ref_handle"]), w["ref_offset"], b(w["event_handle"]), w["event_sync"])
expect = torch.arange(t.numel(), device="cuda", dtype=torch.int64).to(torch.uint8)
if sys.argv[1] == "write":
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(10):
        t.copy_(expect)
    torch.cuda.synchronize()
    print(json.dumps({"d2d_gb_per_s": 10 * t.numel() / (time.perf_counter() - t0) / 1e9}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # a trainer that dies with the memory mapped
else:
    print(json.dumps({"read_back_bitwise": bool(torch.equal(t, expect))}), flush=True)
"""


def check_cuda_ipc(mb: int) -> dict:
    """The keeper-like parent holds the allocation; its IPC handle travels as JSON (no pickle)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    held = torch.zeros(mb << 20, dtype=torch.uint8, device="cuda")
    _rebuild, a = reduce_tensor(held)
    e = lambda x: None if x is None else base64.b64encode(x).decode()  # noqa: E731
    wire = {"size": list(a[1]), "stride": list(a[2]), "offset": a[3], "device": a[6], "handle": e(a[7]),
            "storage_size": a[8], "storage_offset": a[9], "ref_handle": e(a[11]), "ref_offset": a[12],
            "event_handle": e(a[13]), "event_sync": a[14]}
    line = json.dumps(wire) + "\n"
    out = {}
    w = subprocess.run([sys.executable, "-c", IPC_CHILD, "write"], input=line, capture_output=True, text=True,
                       timeout=120)
    out["writer_exit"] = w.returncode
    out.update(json.loads(w.stdout.strip().splitlines()[0]) if w.stdout.strip() else {"writer_error": w.stderr[-1500:]})
    torch.cuda.synchronize()
    expect = torch.arange(held.numel(), device="cuda", dtype=torch.int64).to(torch.uint8)
    out["keeper_sees_it"] = bool(torch.equal(held, expect))
    r = subprocess.run([sys.executable, "-c", IPC_CHILD, "read"], input=line, capture_output=True, text=True,
                       timeout=120)
    out.update(json.loads(r.stdout.strip().splitlines()[0]) if r.stdout.strip() else {"reader_error": r.stderr[-1500:]})
    if not (out["keeper_sees_it"] and out.get("read_back_bitwise")):
        raise AssertionError(f"CUDA IPC retention failed: {out}")
    return out


def check_keeper_pinned(mb: int) -> dict:
    """The mirror's snapshots in a keeper's shared-memory segment (as with ``retain.keeper``), page-
    locked in place: the capture into them must be asynchronous (the training thread held about as
    long as with private pinned buffers), and the committed copy bitwise the state."""
    import torch

    from hotspare.retain import RetainedSegment, RetainedSnapshots

    numel = mb * (1 << 20) // 4
    shm = tempfile.mkdtemp(prefix="hotspare-gpu-shm-", dir="/dev/shm")
    segments = []

    def snapshots_for(r):
        def make(layout):
            seg = RetainedSegment.create(os.path.join(shm, f"r{r}"), r, layout.id, layout.nbytes, 64 << 20)
            segments.append(seg)
            return RetainedSnapshots(seg, layout, pin_memory=True)
        return make

    mirrors = _two_mirrors(True, snapshots=[snapshots_for(0), snapshots_for(1)])
    states = [[("fp32.0", torch.randn(numel, device="cuda"))] for _ in range(2)]
    held, expected = [[], []], [{}, {}]

    def timed(r):
        m = mirrors[r]
        for v in range(1, 8):
            with torch.no_grad():
                m.before_update()
                states[r][0][1].add_(1.0)
                expected[r][v] = sha(states[r][0][1])
            before = m.stats.capture_s
            m.on_step(v, lambda: states[r], lambda: {"v": v})
            held[r].append(m.stats.capture_s - before)
        m.flush()

    _run_ranks(timed)
    out = {"registered": all(b.is_pinned() for b in mirrors[0].snapshots.buffers)}
    version, buf = mirrors[0].read_committed(1)
    out["bitwise"] = sha(mirrors[0].layout.views(buf)[0]) == expected[1][version]
    out["retained_versions"] = segments[0].versions_by_slot() if segments else None
    steady = sorted(held[0][1:])
    out["capture_ms"] = 1e3 * steady[len(steady) // 2]
    out["bytes"] = mirrors[0].layout.nbytes
    for m in mirrors:
        m.close()
    for seg in segments:
        seg.close()
    for name in os.listdir(shm):
        os.unlink(os.path.join(shm, name))
    os.rmdir(shm)
    if not (out["registered"] and out["bitwise"]):
        raise AssertionError(f"keeper segment capture: {out}")
    return out


KEEPER_DEVICE_CHILD = r"""
import hashlib, json, os, signal, sys, time, torch
from hotspare.keeper import KeeperClient
from hotspare.mirror import Mirror
from hotspare.snapshot import Layout
from hotspare.transport import LocalFabric
sock, role, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.cuda.set_device(0)
numel = mb * (1 << 20) // 8
g = torch.Generator(device="cuda").manual_seed(1)
named = [("fp32.0", torch.randn(numel, device="cuda", generator=g)),
         ("optim.0.exp_avg", torch.randn(numel, device="cuda", generator=g)),
         ("rng.cpu", torch.get_rng_state())]
digest = lambda ts: hashlib.sha256(b"".join(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                                            for t in ts)).hexdigest()
client = KeeperClient(sock, timeout_s=120, device_tier=True)
if role == "trainer":
    notes = []
    m = Mirror(0, 0, {0: []}, LocalFabric().endpoint(0), lambda t: None, chunk_bytes=64 << 20, timeout_s=120,
               pin_memory=True, snapshots=client.snapshots_for(0, 64 << 20, 0, notes.append, True, 0))
    held = []
    for v in range(1, 7):
        with torch.no_grad():
            m.before_update()
            named[0][1].add_(1.0)
            named[1][1].mul_(0.5)
        before = m.stats.capture_s
        m.on_step(v, lambda: named, lambda: {"v": v})
        held.append(m.stats.capture_s - before)
        want = digest([t for n, t in named if not n.startswith("rng.")])
    m.flush()
    seg = m.snapshots.segment
    steady = sorted(held[1:])
    print(json.dumps({"trainer_digest": want, "device_record": seg.device_record()[0], "notes": notes,
                      "capture_ms": 1e3 * steady[len(steady) // 2], "device_is_cuda": m.snapshots.device.is_cuda}),
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # a trainer crash with its node alive
else:
    layout = Layout.of(named)
    kept, detail = client.take_over(0, lambda i: layout if i == layout.id else None)
    live = [t for n, t in named if not n.startswith("rng.")]
    for t in live:
        t.zero_()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for t, v in zip(live, layout.views(kept.device)):
        t.copy_(v)
    torch.cuda.synchronize(); dev_s = time.perf_counter() - t0
    got = digest(live)
    host = kept.segment.slots[kept.good[kept.device_version]]
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for t, v in zip(live, layout.views(host)):
        t.copy_(v)
    torch.cuda.synchronize(); host_s = time.perf_counter() - t0
    print(json.dumps({"spare_digest": got, "host_digest": digest(live), "detail": detail,
                      "device_version": kept.device_version, "restore_from_device_ms": 1e3 * dev_s,
                      "restore_from_host_ms": 1e3 * host_s, "bytes": sum(t.numel() * 4 for t in live)}), flush=True)
"""


def check_keeper_device(mb: int) -> dict:
    """The keeper's GPU tier end to end on one GPU: a real keeper process; a trainer process whose
    mirror captures into the keeper's host segment and its device buffer, then is SIGKILLed; a
    spare process that takes the rank over from the keeper and restores from the device copy.
    The spare's state must equal the trainer's last version bitwise, from device and host alike."""
    from hotspare import keeper

    job = f"gpucheck{os.getpid()}"
    sock = os.path.join(tempfile.mkdtemp(prefix="hotspare-gpu-"), "k.sock")
    proc = keeper.start(job, 0, sock)
    out = {}
    try:
        for role in ("trainer", "spare"):
            r = subprocess.run([sys.executable, "-c", KEEPER_DEVICE_CHILD, sock, role, str(mb)], capture_output=True,
                               text=True, timeout=300)
            lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
            if not lines:
                raise AssertionError(f"{role} exited {r.returncode}: {r.stderr[-2000:]}")
            out.update(json.loads(lines[-1]))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out["segments_left"] = [n for n in os.listdir("/dev/shm") if n.startswith(f"hotspare-{job}") or (
        keeper.CUDA_IPC_RE.match(n) and int(keeper.CUDA_IPC_RE.match(n)["pid"], 16) == proc.pid)]
    out["bitwise"] = out["spare_digest"] == out["trainer_digest"] == out["host_digest"]
    if not (out["bitwise"] and out["device_version"] == 6 and not out["segments_left"]):
        raise AssertionError(f"keeper device tier: {out}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--mb", type=int, default=1024, help="size of the mirror check's state, MiB")
    ap.add_argument("--only", default="", help="comma-separated sections")
    ap.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    import torch

    for key, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
               "cuda_available": torch.cuda.is_available(),
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    only = set(filter(None, a.only.split(",")))
    tmp = tempfile.mkdtemp(prefix="hotspare-gpu-")
    checks = {"mirror": lambda: check_mirror(a.mb), "deepspeed": lambda: check_deepspeed(tmp),
              "megatron": lambda: check_megatron(tmp),
              "deepspeed_stage": lambda: check_deepspeed_stage(tmp, a.stage), "nccl": lambda: check_nccl(tmp),
              "cuda_ipc": lambda: check_cuda_ipc(min(a.mb, 512)), "keeper_pinned": lambda: check_keeper_pinned(a.mb),
              "keeper_device": lambda: check_keeper_device(min(a.mb, 1024))}
    for name, fn in checks.items():
        if (not only and name != "deepspeed_stage") or name in only:
            section(results, name)(fn)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict) or "traceback" not in v},
                     default=str)[:4000])
    return 0 if all(v.get("ok") for v in results.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
