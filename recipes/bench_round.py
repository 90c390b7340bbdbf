"""What one mirror round costs in CPU, without training: ``num_ranks`` processes (gloo,
127.0.0.1, one rank per logical node) run hotspare's :class:`~hotspare.mirror.Mirror` on a
fixed state of ``snapshot_bytes``, one round every ``gap_s`` seconds, and measure the CPU their
processes use per round (every thread: the mirror thread, gloo's, the capture on the main
thread). bench_overhead.py measures the same cost inside a training job, where it is a few
percent of a step and the noise is as large; here it is the whole signal, so a change to the
round shows within one run.

    python recipes/bench_round.py out=round.json                   # tier2=stripe, k=2, m=1: 3 ranks
    python recipes/bench_round.py out=r.json tier2=mirror num_ranks=4
    python recipes/bench_round.py out=r.json snapshot_bytes=50000000 rounds=50

Writes one JSON object: the settings, ``runs`` (per repetition and rank: ``process_cpu_ms``,
``mirror_thread_cpu_ms``, ``capture_cpu_ms`` (the training thread's on_step), ``round_wall_ms``
(a round's start to its end on the mirror thread), all per round) and the medians over repetitions of the per-run means (``process_cpu_ms``, ...).
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from hotspare.config import ConfigError, check_choice, from_mapping

KEYS = ("process_cpu_ms", "mirror_thread_cpu_ms", "capture_cpu_ms", "round_wall_ms")


@dataclass
class BenchRoundConfig:
    out: str = "bench_round.json"
    """Where the JSON result goes."""
    tier2: str = "stripe"
    """``stripe`` (zfec shares, k+m ranks) or ``mirror`` (full copies, ``replicas`` each)."""
    num_ranks: int = 0
    """Ranks, one per logical node; 0: k+m for a stripe, 4 for a mirror."""
    k: int = 2
    """Stripe: data shares."""
    m: int = 1
    """Stripe: parity shares."""
    replicas: int = 1
    """Mirror: full copies of each rank's state on other ranks."""
    snapshot_bytes: int = 590_000
    """Bytes of state per rank (590 KB: the tiny GPT of bench_overhead's stripe run, per rank)."""
    chunk_bytes: int = 4 << 20
    """Bytes per message after a transfer's first (hotspare.mirror.chunk_mb)."""
    rounds: int = 200
    """Measured rounds per repetition (after ``warmup`` rounds)."""
    warmup: int = 10
    """Rounds before the measured ones (the receivers' buffers are allocated there)."""
    gap_s: float = 0.01
    """Seconds between rounds (the 'iteration'; the main thread sleeps, so it costs no CPU)."""
    repeats: int = 3
    """Repetitions, each with fresh processes; the JSON's top-level values are their medians."""
    timeout_s: float = 120.0
    """Each repetition's limit."""

    def check(self) -> "BenchRoundConfig":
        check_choice("tier2", self.tier2, ("stripe", "mirror"))
        n = self.num_ranks or (self.k + self.m if self.tier2 == "stripe" else 4)
        if n < 2:
            raise ConfigError(f"num_ranks={n}: a round needs at least 2 ranks")
        for key in ("rounds", "repeats", "snapshot_bytes", "chunk_bytes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be at least 1")
        self.num_ranks = n
        return self


ConfigStore.instance().store(name="bench_round_schema", node=BenchRoundConfig)


def worker(cfg: BenchRoundConfig, rank: int, port: int, out: str) -> None:
    """One rank: mirror a fixed state ``cfg.rounds`` times and write what its process spent."""
    import torch
    import torch.distributed as dist

    from hotspare import erasure
    from hotspare.mirror import Mirror
    from hotspare.placement import place
    from hotspare.transport import GlooTransport

    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.num_ranks, timeout=timeout)
    data, control = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    nodes = list(range(cfg.num_ranks))
    if cfg.tier2 == "stripe":
        holders, stripe = erasure.place_shares(nodes, cfg.k, cfg.m), (cfg.k, cfg.m)
    else:
        holders, stripe = place(nodes, cfg.replicas), None

    def agree(t):
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)

    mirror = Mirror(rank, 0, holders, GlooTransport(data, rank), agree, stripe=stripe, chunk_bytes=cfg.chunk_bytes,
                    timeout_s=cfg.timeout_s)
    g = torch.Generator().manual_seed(rank)
    state = [("fp32.0", torch.randn(max(1, cfg.snapshot_bytes // 4), generator=g)), ("optim.0.step", torch.ones(1))]
    for v in range(1, cfg.warmup + 1):
        mirror.on_step(v, lambda: state, lambda: {"step": v})
    mirror.flush(cfg.timeout_s)
    dist.barrier(group=control)
    stats = mirror.stats
    rounds0, thread0, wall0 = stats.rounds, stats.round_cpu_s, stats.round_s
    cpu0, capture = time.process_time(), 0.0
    for v in range(cfg.warmup + 1, cfg.warmup + cfg.rounds + 1):
        c = time.thread_time()
        mirror.on_step(v, lambda: state, lambda: {"step": v})
        capture += time.thread_time() - c
        time.sleep(cfg.gap_s)
    mirror.flush(cfg.timeout_s)
    cpu = time.process_time() - cpu0
    n = stats.rounds - rounds0
    result = {"rank": rank, "rounds": n, "process_cpu_ms": 1e3 * cpu / n,
              "mirror_thread_cpu_ms": 1e3 * (stats.round_cpu_s - thread0) / n, "capture_cpu_ms": 1e3 * capture / n,
              "round_wall_ms": 1e3 * (stats.round_s - wall0) / n, "bytes_sent_per_round": stats.bytes_sent / max(1, stats.rounds)}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    mirror.close()
    dist.barrier(group=control)
    dist.destroy_process_group()


def repetition(cfg: BenchRoundConfig, run_dir: str, index: int) -> list[dict]:
    """Start the ranks once, wait for them (bounded), return their results in rank order."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg.timeout_s))
    settings = os.path.join(run_dir, "settings.json")
    with open(settings, "w", encoding="utf-8") as f:
        json.dump(asdict(cfg), f)
    outs = [os.path.join(run_dir, f"rep{index}.rank{r}.json") for r in range(cfg.num_ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", settings, str(r), str(store.port),
                               outs[r]], env=env) for r in range(cfg.num_ranks)]
    deadline = time.monotonic() + cfg.timeout_s
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes is None or any(codes):
        sys.exit(f"bench_round: repetition {index} failed (exit codes {codes or 'timed out'}); see the output above")
    results = []
    for path in outs:
        with open(path, encoding="utf-8") as f:
            results.append(json.load(f))
    return results


@hydra.main(version_base=None, config_path="../configs", config_name="bench_round")
def main(raw) -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg = from_mapping(BenchRoundConfig, OmegaConf.to_container(raw, resolve=True)).check()
    run_dir = HydraConfig.get().runtime.output_dir
    runs = [repetition(cfg, run_dir, i) for i in range(cfg.repeats)]
    means = {key: [statistics.fmean(r[key] for r in ranks) for ranks in runs] for key in KEYS}
    report = {**asdict(cfg), "runs": runs, **{key: statistics.median(v) for key, v in means.items()},
              "per_repeat": means}
    with open(cfg.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"{cfg.tier2} on {cfg.num_ranks} ranks, {cfg.snapshot_bytes} B per rank, medians of {cfg.repeats} "
          f"(ms per round): " + ", ".join(f"{key} {report[key]:.3f}" for key in KEYS))
    print(f"wrote {os.path.abspath(cfg.out)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        with open(sys.argv[2], encoding="utf-8") as f:
            worker(BenchRoundConfig(**json.load(f)), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        sys.exit(0)
    main()
