"""hotspare next to the systems its users could pick instead, in one run: the same smoke GPT,
the same data (each rank's batch a function of seed, step and rank), 4 training processes on 2
logical nodes, the same fault (the process of rank ``kill_rank`` SIGKILLed before the forward of
step ``kill_step``), each system as its users run it (docs/peers.md):

- ``hotspare``: the default configuration (ZeRO 2 under DeepSpeed, the node keepers on, a spare
  per node); ``hotspare_peers_only``: the keepers off (the state comes from the peers' mirrors);
- ``torchft`` (0.2.0): 4 replica groups of one process, its Lighthouse, its DDP and Optimizer
  wrappers, healing over PGTransport; the killed process is started again by this recipe the way
  torchelastic would (it looks every ``respawn_poll_s``);
- ``nvrx_inprocess`` (nvidia-resiliency-ext 0.4.1, the newest that installs here): its
  in-process restart Wrapper with one reserve process;
- ``deepspeed_restart`` and ``memory_restart``: the job stops, every process starts again and
  loads the newest checkpoint (every ``checkpoint_every`` steps, or to /dev/shm every step).

    python recipes/bench_peers.py out=peers.json
    python recipes/bench_peers.py out=p.json 'systems=[hotspare,torchft]' train.steps=200

Every measure is taken from the fault (the victim records the moment before it kills itself)
and the processes' own step records, the same way for every system (:mod:`hotspare.testing.peers`):
``survivor_downtime_s``, ``time_to_full_strength_s``, ``lost_steps`` (and per process),
``gpu_seconds_lost`` (fault to back-at-progress at full strength, summed over the 4 processes,
minus their useful steps), ``standing_spare_gpus`` (devices held by spares or reserves that
train nothing), ``step_time_s`` and ``step_time_no_ft_s`` (median step of a run without a fault,
with and without the system), ``bitwise_identical`` and ``max_loss_diff`` (against the same
system's run without a fault, over the steps from the fault on); ``error`` for a system that did
not run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

import bench_recovery
from hotspare.config import ConfigError, from_mapping
from hotspare.testing import job as gpt_job
from hotspare.testing import peers
from hotspare.testing.harness import ranks_of

SYSTEMS = ("hotspare", "hotspare_peers_only", "torchft", "nvrx_inprocess", "deepspeed_restart", "memory_restart")
WORKERS = os.path.dirname(gpt_job.WORKER)


@dataclass
class BenchPeersConfig(gpt_job.GPTJobConfig):
    out: str = "bench_peers.json"
    kill_rank: int = 1
    """The rank whose process is SIGKILLed (the victim), before the forward of ``kill_step``."""
    kill_step: int = 60
    checkpoint_every: int = 50
    """The DeepSpeed restart baseline's checkpoint interval (steps)."""
    checkpoint_dir: str = ""
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    gloo_timeout_s: float = 2.0
    """torchft's and NVRx's process-group timeout: on gloo a survivor not next to the dead process
    in the ring waits this long (gloo cannot be aborted)."""
    torchft_min_replicas: int = 3
    lighthouse_heartbeat_ms: int = 1000
    lighthouse_join_ms: int = 1000
    respawn_poll_s: float = 0.1
    """How often the torchft supervisor looks for a dead process (torchelastic's monitor interval)."""
    system_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for s in self.systems:
            if s not in SYSTEMS:
                raise ConfigError(f"systems: {s!r} is not one of {', '.join(SYSTEMS)}")
        if self.parallel.num_ranks != 4 or self.parallel.logical_nodes != 2:
            raise ConfigError("bench_peers runs 4 processes on 2 logical nodes (parallel.num_ranks=4, logical_nodes=2)")
        if not 0 < self.kill_rank < 4:
            raise ConfigError(f"kill_rank={self.kill_rank} must be 1, 2 or 3")
        if not 5 < self.kill_step < self.train.steps - 20:
            raise ConfigError(f"kill_step={self.kill_step} must leave 5 steps before and 20 after (train.steps="
                              f"{self.train.steps})")
        for key in ("gloo_timeout_s", "respawn_poll_s", "system_timeout_s"):
            if not 0 < getattr(self, key) < 3600:
                raise ConfigError(f"{key}={getattr(self, key)} must be in (0, 3600) seconds")


gpt_job.register()
ConfigStore.instance().store(name="bench_peers_schema", node=BenchPeersConfig)


def _free_ports(n: int) -> int:
    """A port P with P..P+n-1 free now (on 127.0.0.1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + n < 65536 and all(_free(port + i) for i in range(1, n)):
            return port
    raise RuntimeError("no run of free ports on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ---- hotspare and the DeepSpeed restarts: the project's own job ---------------------------------
def _hotspare_steps(ranks: list[dict], world: int, attempt: int = 0) -> list[peers.Step]:
    """Each rank's steps (the last time each ended: a step done again after a recovery or a
    restart shows only then; ``attempt`` 1 marks a restarted run's)."""
    return [peers.Step(r["rank"], int(k), t, True, world, True, float.fromhex(r["losses"][k]) if k in r["losses"]
                       else None, attempt) for r in ranks for k, t in r["step_end"].items()]


def _landed_steps(ranks: list[dict], world: int, fault: dict) -> list[peers.Step]:
    """A hotspare run's steps: a step's time is its last, so one from the landing version on that
    ended after the fault was done again (attempt 1); one before it that a survivor finished just
    after the victim's fault record belongs to the run before the fault."""
    landing = min((rec["version"] for r in ranks for rec in r.get("recoveries", [])), default=fault["step"])
    return [dataclasses.replace(s, attempt=1) if s.t > fault["t"] and s.step >= landing else s
            for s in _hotspare_steps(ranks, world)]


def _losses(ranks) -> dict[int, float]:
    r0 = next(r for r in ranks if r["rank"] == 0)
    return {int(k): float.fromhex(v) for k, v in r0["losses"].items()}


def _same_state(ref: list[dict], got: list[dict]) -> bool:
    """Every rank's final fp32, optimizer and host state as the reference's, and each loss it
    recorded the reference's for that step."""
    keys = ("fp32_digest", "optimizer_digest", "state_digest")
    by = {r["rank"]: r for r in got}
    return sorted(by) == sorted(r["rank"] for r in ref) and all(
        all(a.get(k) == by[a["rank"]].get(k) for k in keys)
        and all(a["losses"].get(step) == loss for step, loss in by[a["rank"]]["losses"].items()) for a in ref)


def deepspeed_systems(job, bench, run_dir: str, out: dict) -> None:
    world = bench.parallel.num_ranks
    ref_dir = os.path.join(run_dir, "uninterrupted")
    if gpt_job.launch(job, ref_dir, mode="hotspare") != 0:
        raise RuntimeError("the uninterrupted hotspare run failed; see its output above")
    ref = list(ranks_of(ref_dir).values())
    step_time = peers.steady_step_time(_hotspare_steps(ref, world))
    plain = dataclasses.replace(job, hotspare=dataclasses.replace(job.hotspare, enabled=False))
    plain_dir = os.path.join(run_dir, "deepspeed_no_ft")
    if gpt_job.launch(plain, plain_dir, mode="train", keeper=False, spares_per_node=0) != 0:
        raise RuntimeError("the DeepSpeed run without hotspare failed; see its output above")
    no_ft = peers.steady_step_time(_hotspare_steps(list(ranks_of(plain_dir).values()), world))
    for system, keeper in (("hotspare", True), ("hotspare_peers_only", False)):
        if system not in bench.systems:
            continue
        d = os.path.join(run_dir, system)
        _, ranks = bench_recovery.run_hotspare(job, bench, d, keeper=keeper)
        fault = json.load(open(os.path.join(d, "fault.json"), encoding="utf-8"))
        run = peers.Run(_landed_steps(ranks, world, fault), fault["t"], fault["step"], bench.kill_rank, world)
        out[system] = {**peers.measure(run, step_time), "standing_spare_gpus": 0, "standing_spare_processes": 2,
                       "step_time_s": step_time, "step_time_no_ft_s": no_ft,
                       "bitwise_identical": _same_state(ref, ranks),
                       "max_loss_diff": peers.max_loss_diff(_losses(ref), _losses(ranks), bench.kill_step)}
    for system, every in (("deepspeed_restart", bench.checkpoint_every), ("memory_restart", 1)):
        if system not in bench.systems:
            continue
        d = os.path.join(run_dir, system)
        ckpt = f"/dev/shm/hotspare-peers-{os.getpid()}" if system == "memory_restart" else \
            (bench.checkpoint_dir or os.path.join(run_dir, "checkpoints"))
        try:
            summary = bench_recovery.run_restart(job, bench, d, ckpt, every)
        finally:
            if system == "memory_restart":
                shutil.rmtree(ckpt, ignore_errors=True)
        fault = json.load(open(os.path.join(d, "first", "fault.json"), encoding="utf-8"))
        ranks = list(ranks_of(os.path.join(d, "restarted")).values())
        run = peers.Run(_hotspare_steps(ranks, world, attempt=1), fault["t"], fault["step"], bench.kill_rank, world)
        # Its steady step: DeepSpeed's, plus its checkpoint saves spread over their interval.
        out[system] = {**peers.measure(run, no_ft), "standing_spare_gpus": 0, "standing_spare_processes": 0,
                       "step_time_s": no_ft + summary["checkpoint_save_s_mean"] / every, "step_time_no_ft_s": no_ft,
                       "checkpoint_every": every,
                       "checkpoint_save_s_mean": summary["checkpoint_save_s_mean"],
                       "bitwise_identical": _same_state(ref, ranks),
                       "max_loss_diff": peers.max_loss_diff(_losses(ref), _losses(ranks), bench.kill_step)}


# ---- torchft and NVRx: their own loops over the same model and data -----------------------------
def _run_json(job, bench, out_dir: str, kill: bool) -> str:
    os.makedirs(out_dir, exist_ok=True)
    run = {"model": dataclasses.asdict(job.model), "train": dataclasses.asdict(job.train), "corpus": job.corpus,
           "steps": bench.train.steps, "world": bench.parallel.num_ranks, "kill_slot": bench.kill_rank,
           "kill_step": bench.kill_step if kill else -1, "out_dir": out_dir, "gloo_timeout_s": bench.gloo_timeout_s,
           "min_replicas": bench.torchft_min_replicas}
    path = os.path.join(out_dir, "run.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(run, f, indent=1)
    return path


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
            "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "ERROR", **{k: str(v) for k, v in extra.items()}}


def _spawn(argv: list[str], env: dict, log: str) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, *argv], env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


END_GRACE_S = 15.0
"""Once every rank recorded its last step, how long its processes get to exit on their own (an
NVRx process sometimes never leaves the Wrapper's termination barrier: its store's host left)."""


def _end(procs, timeout_s: float, out_dir: str, last_step: int, each=None, world: int = 4) -> None:
    """Wait for ``procs`` (a dict) to exit, calling ``each()`` between looks; SIGKILL what is left
    at ``timeout_s``, or END_GRACE_S after all ``world`` ranks recorded ``last_step``."""
    deadline, look = time.monotonic() + timeout_s, 0.0
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            if each is not None:
                each()
            if deadline - time.monotonic() > END_GRACE_S and time.monotonic() > look:
                look = time.monotonic() + 1.0
                done = {s.slot for s in peers.read_records(out_dir)[0] if s.step == last_step and s.committed}
                if len(done) == world:
                    deadline = time.monotonic() + END_GRACE_S
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def torchft_run(job, bench, out_dir: str, kill: bool, plain: bool = False) -> list[peers.Step]:
    config = _run_json(job, bench, out_dir, kill)
    worker = os.path.join(WORKERS, "peer_torchft.py")
    world = bench.parallel.num_ranks
    if plain:
        port = _free_ports(1)
        procs = {s: _spawn([worker, "--config", config, "--slot", str(s), "--plain"],
                           _env(MASTER_PORT=port), os.path.join(out_dir, f"slot{s}.log")) for s in range(world)}
        _end(procs, bench.system_timeout_s, out_dir, bench.train.steps - 1)
        return peers.read_records(out_dir)[0]
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=bench.torchft_min_replicas,
                                  join_timeout_ms=bench.lighthouse_join_ms, quorum_tick_ms=100,
                                  heartbeat_timeout_ms=bench.lighthouse_heartbeat_ms)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"

    def start(slot: int, incarnation: int) -> subprocess.Popen:
        return _spawn([worker, "--config", config, "--slot", str(slot), "--incarnation", str(incarnation)],
                      _env(MASTER_PORT=_free_ports(1), TORCHFT_LIGHTHOUSE=address, RANK=0, WORLD_SIZE=1),
                      os.path.join(out_dir, f"slot{slot}.log"))

    procs = {s: start(s, 0) for s in range(world)}
    restarted = set()

    def supervise() -> None:  # torchelastic's part: the killed process is started again
        for s, p in list(procs.items()):
            if p.poll() == -signal.SIGKILL and s not in restarted:
                restarted.add(s)
                procs[s] = start(s, 1)
        time.sleep(bench.respawn_poll_s)

    try:
        _end(procs, bench.system_timeout_s, out_dir, bench.train.steps - 1, supervise)
    finally:
        lighthouse.shutdown()
    return peers.read_records(out_dir)[0]


def nvrx_run(job, bench, out_dir: str, kill: bool) -> list[peers.Step]:
    config = _run_json(job, bench, out_dir, kill)
    worker = os.path.join(WORKERS, "peer_nvrx.py")
    world = bench.parallel.num_ranks + 1  # one reserve
    port = _free_ports(2)
    procs = {r: _spawn([worker, "--config", config], _env(RANK=r, WORLD_SIZE=world, MASTER_PORT=port),
                       os.path.join(out_dir, f"proc{r}.log")) for r in range(world)}
    _end(procs, bench.system_timeout_s, out_dir, bench.train.steps - 1)
    # The Wrapper's monitor processes leave the session (a double fork): end them by pid.
    for r in peers.read_records(out_dir)[1]:
        if r.get("monitor_pid"):
            try:
                os.kill(r["monitor_pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    return peers.read_records(out_dir)[0]


def peer_system(system: str, job, bench, run_dir: str, no_ft: float) -> dict:
    """``system`` with and without the fault; ``no_ft``: torch DDP's steady step, the peers' base."""
    world = bench.parallel.num_ranks
    d = os.path.join(run_dir, system)
    runner = torchft_run if system == "torchft" else nvrx_run
    ref = runner(job, bench, os.path.join(d, "uninterrupted"), kill=False)
    got = runner(job, bench, os.path.join(d, "fault"), kill=True)
    records = peers.read_records(os.path.join(d, "fault"))[1]
    fault = next((r for r in records if r["kind"] == "fault"), None)
    if fault is None:
        raise RuntimeError(f"{system}: the victim never reached step {bench.kill_step}; see {d}/fault/*.log")
    step_time = peers.steady_step_time(ref)
    run = peers.Run(got, fault["t"], fault["step"], bench.kill_rank, world)

    def by_slot(steps):
        return {s.step: s.loss for s in sorted(steps, key=lambda s: s.t) if s.slot == 0 and s.committed}

    ref_losses, losses = by_slot(ref), by_slot(got)
    return {**peers.measure(run, step_time), "standing_spare_gpus": 1 if system == "nvrx_inprocess" else 0,
            "standing_spare_processes": 1 if system == "nvrx_inprocess" else 0,
            "step_time_s": step_time, "step_time_no_ft_s": no_ft,
            "bitwise_identical": losses == {k: ref_losses.get(k) for k in losses},
            "max_loss_diff": peers.max_loss_diff(ref_losses, losses, bench.kill_step)}


@hydra.main(version_base=None, config_path="../configs", config_name="bench_peers")
def main(cfg) -> None:
    data = OmegaConf.to_container(cfg, resolve=True)
    bench = from_mapping(BenchPeersConfig, data)
    run_dir = HydraConfig.get().runtime.output_dir
    job = from_mapping(gpt_job.GPTJobConfig, {k: v for k, v in data.items() if k in
                                              {f.name for f in dataclasses.fields(gpt_job.GPTJobConfig)}})
    systems: dict[str, dict] = {}
    t0 = time.monotonic()
    if any(s in bench.systems for s in ("hotspare", "hotspare_peers_only", "deepspeed_restart", "memory_restart")):
        deepspeed_systems(job, bench, run_dir, systems)
    no_ft = None  # torch DDP without fault tolerance: both peers' base, run once
    for system in ("torchft", "nvrx_inprocess"):
        if system in bench.systems:
            try:
                if no_ft is None:
                    no_ft = peers.steady_step_time(torchft_run(job, bench, os.path.join(run_dir, "ddp_no_ft"),
                                                               kill=False, plain=True))
                systems[system] = peer_system(system, job, bench, run_dir, no_ft)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                systems[system] = {"error": f"{type(exc).__name__}: {exc}"}
    result = {"systems": {s: systems[s] for s in SYSTEMS if s in systems}, "kill_rank": bench.kill_rank,
              "kill_step": bench.kill_step, "steps": bench.train.steps, "num_ranks": bench.parallel.num_ranks,
              "gloo_timeout_s": bench.gloo_timeout_s, "seconds": time.monotonic() - t0,
              "date": time.strftime("%Y-%m-%d"),
              "command": "python recipes/bench_peers.py " + " ".join(HydraConfig.get().overrides.task)}
    with open(bench.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(peers.table(result["systems"]))
    print(f"wrote {bench.out}")


if __name__ == "__main__":
    main()
