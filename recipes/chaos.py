"""Chaos soak: during one long run, SIGKILL random active ranks at random times (seeded; a bounded
number of kills within a bounded window, at least ``min_gap_s`` apart so the spare pool refills),
from outside the job and with no regard for where in the step they land; then check that the
run ended bitwise identical (fp32 state, optimizer state, losses) to an uninterrupted run.

    python recipes/chaos.py out=chaos.json                                  # ZeRO-2, 3 kills
    python recipes/chaos.py out=c.json seed=7 kills=5 train.steps=600 variant=megatron

The rank to kill is drawn from the coordinator's newest plan (so a spare that took a rank can be
killed in turn), its process found by its worker id. JSON: ``kills`` (time after the start,
rank, worker id, generation), ``outcome`` (as in recipes/fault_matrix.py), ``bitwise_identical``,
``recoveries``, ``lost_iterations`` (the most any recovery lost), ``recovery_s`` (each recovery's
longest rank), ``seconds``. Exits 1 unless the run finished bitwise identical with every kill
recovered.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_matrix  # noqa: E402
import gpt_job  # noqa: E402
from hotspare import control  # noqa: E402
from hotspare.control import auth  # noqa: E402
from hotspare.config import ConfigError, from_mapping  # noqa: E402
from hotspare.generation import connect_store  # noqa: E402


@dataclass
class ChaosConfig(gpt_job.GPTJobConfig):
    """The GPT job, and how much chaos."""

    out: str = "chaos.json"
    """Where the JSON result goes."""
    variant: str = "zero2"
    """The host: zero1, zero2, zero3 or megatron (as in the fault matrix)."""
    seed: int = 0
    """Seeds the kill times and the ranks."""
    kills: int = 3
    """How many ranks are killed (fewer if the run ends first)."""
    first_after_s: float = 8.0
    """No kill before this many seconds after the ranks started training."""
    min_gap_s: float = 12.0
    """Seconds between two kills at least (a promoted spare's replacement needs ~10 s to start here)."""
    window_s: float = 60.0
    """Every kill falls within this many seconds after ``first_after_s``."""
    spares: int = 2
    """Spares per logical node."""
    timeout_s: float = 900.0
    """The run is ``hung`` after this long."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in fault_matrix.FRAMEWORKS:
            raise ConfigError(f"variant: {self.variant!r} is not one of {', '.join(fault_matrix.FRAMEWORKS)}")
        if self.kills < 1 or self.min_gap_s <= 0 or self.window_s < (self.kills - 1) * self.min_gap_s:
            raise ConfigError(f"kills={self.kills}, min_gap_s={self.min_gap_s}, window_s={self.window_s}: need kills "
                              f">= 1 and a window of at least (kills - 1) * min_gap_s")


gpt_job.register()
ConfigStore.instance().store(name="chaos_schema", node=ChaosConfig)


def schedule(cfg: ChaosConfig) -> list[float]:
    """Kill times (seconds after training started): seeded, sorted, ``min_gap_s`` apart, within
    the window."""
    rng = random.Random(cfg.seed)
    slack = cfg.window_s - (cfg.kills - 1) * cfg.min_gap_s
    offsets = sorted(rng.uniform(0, slack) for _ in range(cfg.kills))
    return [cfg.first_after_s + o + i * cfg.min_gap_s for i, o in enumerate(offsets)]


def store_port(log_path: str, deadline: float) -> int:
    """The port node 0's launcher picked, from its first log line."""
    while time.monotonic() < deadline:
        m = re.search(r"store [^ ]+:(\d+)", open(log_path, encoding="utf-8", errors="replace").read())
        if m:
            return int(m.group(1))
        time.sleep(0.1)
    raise RuntimeError(f"the launcher did not print its store address in {log_path}")


def soak(cfg: ChaosConfig, job, out_dir: str) -> tuple[int | None, list[dict], str]:
    """Run the job and kill on schedule; (exit code or None if hung, kills, launcher log tail)."""
    worker = gpt_job.MEGATRON_WORKER if job.framework == "megatron" else os.path.join(fault_matrix.RECIPES,
                                                                                    "recovery_worker.py")
    spec = gpt_job.launch_spec(job, out_dir, worker=worker, spares_per_node=cfg.spares, mode="hotspare")
    spec.job_id = f"chaos{os.getpid()}"
    # The soak reads the job's plans as an operator would: with the job's secret.
    spec.job_secret_file = auth.write_secret_file(os.path.join(out_dir, "job.secret"))
    signer = auth.Signer(auth.read_secret_file(spec.job_secret_file), spec.job_id)
    log_path = os.path.join(out_dir, "launcher.log")
    kills: list[dict] = []
    t_start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hotspare.launch", *spec.to_argv()], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **spec.extra_env})
    try:
        store = connect_store("127.0.0.1", store_port(log_path, t_start + 60), 60)
        events = os.path.join(out_dir, "events")
        while proc.poll() is None and not fault_matrix.training_started(events):
            time.sleep(0.2)
        t0 = time.monotonic()
        rng = random.Random(cfg.seed + 1)
        for at in schedule(cfg):
            while proc.poll() is None and time.monotonic() - t0 < at:
                time.sleep(0.05)
            if proc.poll() is not None:
                break
            plan = control.ControlStore(store, signer).current_plan(job.parallel.num_ranks)
            rank = rng.randrange(job.parallel.num_ranks)
            wid = plan.workers[str(rank)]
            pid = fault_matrix.pid_of(spec.job_id, wid)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            kills.append({"t": time.monotonic() - t0, "rank": rank, "worker": wid, "generation": plan.generation,
                          "killed": pid is not None})
            print(f"chaos: t={kills[-1]['t']:.1f} s killed rank {rank} ({wid}, generation {plan.generation})",
                  flush=True)
        code = proc.wait(timeout=max(1.0, cfg.timeout_s - (time.monotonic() - t_start)))
    except subprocess.TimeoutExpired:
        code = None
        fault_matrix.stop(proc, spec.job_id)
    return code, kills, open(log_path, encoding="utf-8", errors="replace").read()[-4000:]


@hydra.main(version_base=None, config_path="../configs", config_name="chaos")
def main(cfg) -> None:
    t_start = time.monotonic()
    data = OmegaConf.to_container(cfg, resolve=True)
    chaos = from_mapping(ChaosConfig, data)
    run_dir = HydraConfig.get().runtime.output_dir
    job = fault_matrix.framework_job(data, chaos.variant)
    world = job.parallel.num_ranks
    ref_dir = os.path.join(run_dir, "uninterrupted")
    code, tail = fault_matrix.run_job(job, ref_dir, 0, chaos.timeout_s)
    ref = fault_matrix.ranks_of(ref_dir)
    if code != 0 or sorted(ref) != list(range(world)):
        sys.exit(f"chaos: the uninterrupted run failed (exit {code}):\n{tail}")
    out_dir = os.path.join(run_dir, "chaos")
    code, kills, tail = soak(chaos, job, out_dir)
    ranks = fault_matrix.ranks_of(out_dir)
    row = fault_matrix.classify(code, tail, ranks, ref, world)
    recoveries = sorted({(rec["generation"], rec["version"]) for r in ranks.values() for rec in r.get("recoveries", [])})
    result = {"variant": chaos.variant, "seed": chaos.seed, "steps": chaos.train.steps, "kills": kills,
              "outcome": row["outcome"], "bitwise_identical": row["bitwise_identical"],
              "lost_iterations": row["lost_iterations"], "recovery_s": row["recovery_s"],
              "recoveries": [{"generation": g, "version": v} for g, v in recoveries], "note": row["note"],
              "exit_code": code, "seconds": time.monotonic() - t_start}
    with open(chaos.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("outcome", "bitwise_identical", "lost_iterations", "recovery_s")}))
    print(f"{len(kills)} kills, {len(recoveries)} recoveries; wrote {os.path.abspath(chaos.out)}")
    if not (row["outcome"] == "recovered" and row["bitwise_identical"] and all(k["killed"] for k in kills)):
        sys.exit(1)


if __name__ == "__main__":
    main()
