"""Recovery time: the same GPT job and the same fault (SIGKILL of a non-zero rank before step N)
recovered three ways, in one run.

- ``hotspare``: in place: a spare takes the rank, state from the survivors' own snapshots and
  the peers' mirrors, no process restarted but the dead one, no file read (no keeper: the
  dead rank's state crosses the network).
- ``keeper``: the same, with the node keepers on (the default configuration): the spare on
  the dead rank's node restores its state from the keeper's shared memory, with no network
  transfer of that state (the events say so: ``network_bytes`` is 0).
- ``stripe``: tier 2 a zfec stripe (``hotspare.retain.k``, ``m``) on k+m logical nodes of one
  rank each; the rank's whole node is lost (its keeper and spare SIGKILLed with it) and a spare
  of another node decodes its state from the shares on the surviving nodes.
- ``deepspeed_restart``: what a DeepSpeed user has today: the job stops, every process is
  started again, ``load_checkpoint`` reads the newest checkpoint (saved every K steps) and the
  steps since are recomputed.
- ``memory_restart``: the strongest restart-based alternative (DLRover Flash Checkpoint,
  Gemini): the checkpoint is written to /dev/shm every step, so only the restart and the
  load remain.
- with ``framework=megatron`` (megatron-core pipeline stages x data parallelism) the restart
  baseline is ``megatron_restart``: megatron-core's ``dist_checkpointing`` save every K
  iterations and load after the restart (``memory_restart`` saves it to /dev/shm every
  iteration); ``stripe`` is DeepSpeed's only here (it needs k+m one-rank nodes).

    python recipes/bench_recovery.py out=recovery.json
    python recipes/bench_recovery.py out=r.json kill_step=60 checkpoint_every=50 zero.stage=3
    python recipes/bench_recovery.py out=m.json framework=megatron
    python recipes/bench_recovery.py out=h.json 'models=[gpt,hf_gpt2,hf_llama]' 'ways=[hotspare,keeper]'

JSON: for each way ``detect_s``, ``rebuild_s``, ``restore_s``, ``recompute_s``, ``total_s``
(fault to the moment training is back at the progress it had when the fault struck) and
``lost_iterations``; top level ``speedup`` (deepspeed_restart, or megatron_restart, / hotspare total),
``speedup_vs_memory_restart``, ``keeper_speedup`` (deepspeed_restart / keeper total),
``stripe_speedup`` (against the 4-rank restart: the stripe job has k+m ranks) and
``bitwise_identical`` (every in-place run against an uninterrupted one of its size). The in-place
ways also write ``protect_s`` (the wait for the first mirror round after the restore: with a
stripe only, 0 with full mirror copies) and ``plan_wait_s`` (the rest of fault-seen-to-resume:
waiting for the coordinator's plan). All times come from one clock (CLOCK_MONOTONIC, shared by
the processes). With ``models`` (a list of ``model.family`` values: the project's GPT and
transformers families built from the same shape) the benchmark runs once per model and the JSON
holds each model's result under ``models``, with ``total_vs_gpt`` (each in-place way's total
over the GPT's) and the spare's ``engine_build_s`` (its engine build after the takeover order).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from hotspare.testing import job as gpt_job
from hotspare.config import ConfigError, from_mapping

WAYS = ("hotspare", "keeper", "stripe", "deepspeed_restart", "megatron_restart", "memory_restart")
WAYS_OF = {"deepspeed": ("hotspare", "keeper", "stripe", "deepspeed_restart", "memory_restart"),
           "megatron": ("hotspare", "keeper", "megatron_restart", "memory_restart")}


@dataclass
class BenchRecoveryConfig(gpt_job.GPTJobConfig):
    """The GPT job plus the benchmark's fault and baselines."""

    out: str = "bench_recovery.json"
    """Where the JSON result goes."""
    kill_rank: int = 1
    """The rank killed (SIGKILL) before the forward of ``kill_step``."""
    kill_step: int = 60
    """The step (0-based) before which the rank dies."""
    checkpoint_every: int = 50
    """K: the DeepSpeed baseline saves a checkpoint every K steps."""
    checkpoint_dir: str = ""
    """Where the DeepSpeed baseline's checkpoints go; empty: under the run directory."""
    models: list[str] = field(default_factory=list)
    """Model families to run the benchmark for, one after the other (empty: ``model.family`` only)."""
    ways: list[str] = field(default_factory=list)
    """Which ways to run (empty: every way of the framework: hotspare, keeper, stripe,
    deepspeed_restart, memory_restart; on megatron hotspare, keeper, megatron_restart,
    memory_restart)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        allowed = WAYS_OF[self.framework]
        if not self.ways:
            self.ways = list(allowed)
        for w in self.ways:
            if w not in allowed:
                raise ConfigError(f"ways: {w!r} is not one of {', '.join(allowed)} (framework={self.framework})")
        if not 0 < self.kill_rank < self.parallel.num_ranks:
            raise ConfigError(f"kill_rank={self.kill_rank} must be a non-zero rank below parallel.num_ranks="
                              f"{self.parallel.num_ranks}")
        if not 0 < self.kill_step < self.train.steps:
            raise ConfigError(f"kill_step={self.kill_step} must be in (0, train.steps={self.train.steps})")
        if self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every} must be at least 1")
        for family in self.models:
            dataclasses.replace(self.model, family=family)  # checks the name
            if family != "gpt" and self.framework != "deepspeed":
                raise ConfigError(f"models: {family} runs with framework=deepspeed only")


gpt_job.register()
ConfigStore.instance().store(name="bench_recovery_schema", node=BenchRecoveryConfig)


def _ranks(out_dir: str) -> list[dict]:
    return [json.load(open(p, encoding="utf-8")) for p in sorted(glob.glob(os.path.join(out_dir, "rank*.json")))]


def _events(out_dir: str) -> list[dict]:
    rows = []
    for p in glob.glob(os.path.join(out_dir, "events", "*.jsonl")):
        rows += [json.loads(line) for line in open(p, encoding="utf-8")]
    return rows


def _regained(ranks: list[dict], progress: int) -> float:
    """When every rank had finished step ``progress - 1`` (its last time: replays overwrite)."""
    return max(r["step_end"][str(progress - 1)] for r in ranks)


def stripe_job(job):
    """The job on k+m logical nodes of one rank each, tier 2 a stripe."""
    rc = job.hotspare.retain
    n = rc.k + rc.m
    return dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, num_ranks=n, logical_nodes=n),
                               hotspare=dataclasses.replace(job.hotspare,
                                                            retain=dataclasses.replace(rc, tier2="stripe")))


def run_hotspare(job, bench, out_dir, keeper: bool, lose_node: bool = False) -> tuple[dict, list[dict]]:
    retain = dataclasses.replace(job.hotspare.retain, keeper=keeper)
    job = dataclasses.replace(job, hotspare=dataclasses.replace(job.hotspare, events_dir=os.path.join(out_dir, "events"),
                                                                retain=retain))
    code = gpt_job.launch(job, out_dir, spares_per_node=1, keeper=keeper, mode="hotspare",
                          kill_rank=bench.kill_rank, kill_step=bench.kill_step, lose_node=lose_node)
    if code != 0:
        raise RuntimeError(f"the hotspare run failed (exit {code}); see its output above")
    fault = json.load(open(os.path.join(out_dir, "fault.json"), encoding="utf-8"))
    ranks, events = _ranks(out_dir), _events(out_dir)
    seen = [e["t"] for e in events if e["kind"] == "failure_seen"]
    resumed = max(e["t"] for e in events if e["kind"] == "resume")
    rebuild = max(e["seconds"] for e in events if e["kind"] == "rebuild")
    restore = max(e["seconds"] for e in events if e["kind"] == "restore")
    version = min(e["version"] for e in events if e["kind"] == "resume")
    restores = [e for e in events if e["kind"] == "restore"]
    # The wait for the first round after the restore (the landing version copied to the holders).
    protect = max((e.get("protect_s", 0.0) for e in events if e["kind"] == "resume"), default=0.0)
    back = _regained(ranks, fault["step"]) if version < fault["step"] else resumed
    detect = min(seen) - fault["t"]
    return {"detect_s": detect, "rebuild_s": rebuild, "restore_s": restore,
            "protect_s": protect, "plan_wait_s": resumed - min(seen) - rebuild - restore - protect,
            "recompute_s": back - resumed, "total_s": back - fault["t"],
            "lost_iterations": fault["step"] - version, "landing_step": version,
            "network_bytes": sum(e["bytes_in"] for e in restores),
            "engine_build_s": max((e.get("engine_build_s", 0.0) for e in events if e["kind"] == "resume"),
                                  default=0.0),
            "sources": sorted({e["source"] for e in restores if e["source"] != "self"})}, ranks


def run_restart(job, bench, out_dir, ckpt_dir: str, every: int) -> dict:
    first, second = os.path.join(out_dir, "first"), os.path.join(out_dir, "restarted")
    opts = {"mode": "restart", "checkpoint_dir": ckpt_dir, "checkpoint_every": every}
    code = gpt_job.launch(job, first, kill_rank=bench.kill_rank, kill_step=bench.kill_step,
                          **opts)
    t_down = time.monotonic()  # the launcher has stopped every process: the job is down
    if code == 0:
        raise RuntimeError("the restart baseline's first run did not fail; the fault did not fire")
    fault = json.load(open(os.path.join(first, "fault.json"), encoding="utf-8"))
    code = gpt_job.launch(job, second, resume=True, **opts)
    if code != 0:
        raise RuntimeError(f"the restarted run failed (exit {code}); see its output above")
    ranks = _ranks(second)
    loaded = ranks[0]["loaded_step"]
    t_init, t_loaded = max(r["t_init"] for r in ranks), max(r["t_loaded"] for r in ranks)
    back = _regained(ranks, fault["step"]) if loaded < fault["step"] else t_loaded
    saves = [s for r in ranks for s in r["save_s"]]
    return {"detect_s": t_down - fault["t"], "rebuild_s": t_init - t_down, "restore_s": t_loaded - t_init,
            "recompute_s": back - t_loaded, "total_s": back - fault["t"],
            "lost_iterations": fault["step"] - loaded, "landing_step": loaded, "checkpoint_every": every,
            "checkpoint_save_s_mean": sum(saves) / len(saves) if saves else 0.0}


def bench_one(job, bench, run_dir: str) -> dict:
    """Every way of ``bench`` on ``job``: the result's JSON object."""
    result = {"model": job.model.family, "framework": bench.framework, "kill_rank": bench.kill_rank,
              "kill_step": bench.kill_step, "steps": bench.train.steps, "num_ranks": bench.parallel.num_ranks}
    if bench.framework == "deepspeed":
        result["zero_stage"] = bench.zero.stage
    else:
        result.update(pipeline_stages=bench.parallel.pipeline_stages, tensor_parallel=bench.parallel.tensor_parallel,
                      virtual_stages=bench.parallel.virtual_stages)
    in_place = [w for w in ("hotspare", "keeper", "stripe") if w in bench.ways]
    refs = {}
    identical = []
    for way in in_place:
        way_job = stripe_job(job) if way == "stripe" else job
        key = way_job.parallel.num_ranks
        if key not in refs:
            ref_dir = os.path.join(run_dir, f"uninterrupted-{key}ranks")
            if gpt_job.launch(way_job, ref_dir, mode="hotspare") != 0:
                sys.exit("bench_recovery: the uninterrupted run failed; see its output above")
            refs[key] = _ranks(ref_dir)
        ref = refs[key]
        result[way], ranks = run_hotspare(way_job, bench, os.path.join(run_dir, way), keeper=way != "hotspare",
                                          lose_node=way == "stripe")
        result[way]["num_ranks"] = key
        identical.append(len(ranks) == len(ref) and all(
            (a["fp32_digest"], a["optimizer_digest"], a["state_digest"]) ==
            (b["fp32_digest"], b["optimizer_digest"], b["state_digest"])
            and all(a["losses"][k] == v for k, v in b["losses"].items()) for a, b in zip(ref, ranks)))
    if in_place:
        result["bitwise_identical"] = all(identical)
    for restart in ("deepspeed_restart", "megatron_restart"):
        if restart in bench.ways:
            ckpt = bench.checkpoint_dir or os.path.join(run_dir, "checkpoints")
            result[restart] = run_restart(job, bench, os.path.join(run_dir, restart), ckpt, bench.checkpoint_every)
    if "memory_restart" in bench.ways:
        shm = f"/dev/shm/hotspare-bench-{os.getpid()}"
        try:
            result["memory_restart"] = run_restart(job, bench, os.path.join(run_dir, "memory_restart"), shm, 1)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    for base, way, key in (("deepspeed_restart", "hotspare", "speedup"),
                           ("megatron_restart", "hotspare", "speedup"),
                           ("memory_restart", "hotspare", "speedup_vs_memory_restart"),
                           ("deepspeed_restart", "keeper", "keeper_speedup"),
                           ("megatron_restart", "keeper", "keeper_speedup"),
                           ("memory_restart", "keeper", "keeper_speedup_vs_memory_restart"),
                           ("deepspeed_restart", "stripe", "stripe_speedup")):
        if base in result and way in result:
            result[key] = result[base]["total_s"] / result[way]["total_s"]
    return result


@hydra.main(version_base=None, config_path="../configs", config_name="bench_recovery")
def main(cfg) -> None:
    data = OmegaConf.to_container(cfg, resolve=True)
    bench = from_mapping(BenchRecoveryConfig, data)
    run_dir = HydraConfig.get().runtime.output_dir
    job_data = {k: v for k, v in data.items() if k not in ("out", "kill_rank", "kill_step", "checkpoint_every",
                                                           "checkpoint_dir", "ways", "models")}
    job = from_mapping(gpt_job.GPTJobConfig, job_data)
    if not bench.models:
        result = bench_one(job, bench, run_dir)
    else:
        result = {"models": {}}
        for family in bench.models:
            model_job = dataclasses.replace(job, model=dataclasses.replace(job.model, family=family))
            result["models"][family] = bench_one(model_job, bench, os.path.join(run_dir, family))
        gpt = result["models"].get("gpt")
        for family, r in result["models"].items():
            if gpt is not None:
                r["total_vs_gpt"] = {w: r[w]["total_s"] / gpt[w]["total_s"] for w in ("hotspare", "keeper", "stripe")
                                     if w in r and w in gpt}
        result["bitwise_identical"] = all(r.get("bitwise_identical", True) for r in result["models"].values())
    with open(bench.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    for family, r in (result["models"].items() if "models" in result else [(None, result)]):
        print_table(r, family)
    if "models" in result:
        print(f"bitwise_identical: {result['bitwise_identical']}")
    print(f"wrote {bench.out}")


def print_table(result: dict, family: str | None = None) -> None:
    if family is not None:
        print(f"model {family}")
    print(f"{'way':<20}{'detect':>9}{'rebuild':>9}{'restore':>9}{'recompute':>11}{'total':>9}{'lost':>6}")
    for way in WAYS:
        if way in result:
            r = result[way]
            print(f"{way:<20}{r['detect_s']:9.2f}{r['rebuild_s']:9.2f}{r['restore_s']:9.2f}{r['recompute_s']:11.2f}"
                  f"{r['total_s']:9.2f}{r['lost_iterations']:6d}")
    for key in ("speedup", "speedup_vs_memory_restart", "keeper_speedup", "keeper_speedup_vs_memory_restart",
                "stripe_speedup", "total_vs_gpt", "bitwise_identical"):
        if key in result:
            print(f"{key}: {result[key]}")


if __name__ == "__main__":
    main()
