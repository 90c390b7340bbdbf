"""The GPT smoke job shared by the recipes and the tests: its typed config schema, the
DeepSpeed config it implies, and launching its ranks through hotspare-run (its ranks run
``workers/job_worker.py``, on DeepSpeed or megatron-core, in the mode run.json names).

The recipes are Hydra entry points over this module, so that train_gpt.py, the benchmarks and
the tests describe one job the same way; :mod:`hotspare.testing.harness` runs a job in the
background and exposes it (port, job id, plan, processes).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from hotspare.config import HotspareConfig, check_choice, from_mapping, to_mapping
from hotspare.launch import LaunchSpec, run
from hotspare.testing.gpt import GPTConfig
from hotspare.testing.harness import ranks_of

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
WORKER = os.path.join(WORKERS, "job_worker.py")
FRAMEWORKS = ("deepspeed", "megatron")


@dataclass
class ParallelConfig:
    """How many ranks, and how they are grouped into (logical) nodes."""

    num_ranks: int = 4
    """Active ranks, all on this machine (DeepSpeed: the data-parallel size; megatron: pipeline
    stages x data-parallel size)."""
    logical_nodes: int = 2
    """Logical nodes the ranks are split into (placement treats each as a separate machine)."""
    store_timeout_s: float = 60.0
    """How long a worker waits to reach the control store."""
    collective_timeout_s: float = 120.0
    """Timeout of the training process group's collectives."""
    spares_per_node: int = 0
    """Standby workers per logical node (hot spares that take a failed rank's place)."""
    successor_wait_s: float = 30.0
    """After a takeover, at most how long before the promoted spare's successor starts
    (hotspare-run ``--successor-wait-s``: it starts once the generation caught up; 0: at once)."""
    pipeline_stages: int = 1
    """megatron only: pipeline-parallel size (the model's layers split into this many stages)."""
    tensor_parallel: int = 1
    """megatron only: tensor-parallel size (each layer's weights split across this many ranks)."""
    virtual_stages: int = 1
    """megatron only: virtual pipeline size (each stage holds this many chunks of layers, run by
    the interleaved 1F1B schedule; 1: plain 1F1B)."""

    def __post_init__(self) -> None:
        for key in ("pipeline_stages", "tensor_parallel", "virtual_stages"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key}={getattr(self, key)} must be at least 1")
        if self.num_ranks % (self.pipeline_stages * self.tensor_parallel):
            raise ValueError(f"parallel.pipeline_stages={self.pipeline_stages} x parallel.tensor_parallel="
                             f"{self.tensor_parallel} must divide parallel.num_ranks={self.num_ranks}")
        if self.spares_per_node < 0:
            raise ValueError(f"parallel.spares_per_node={self.spares_per_node} must be >= 0")
        if self.successor_wait_s < 0:
            raise ValueError(f"parallel.successor_wait_s={self.successor_wait_s} must be >= 0")
        if self.num_ranks < 1:
            raise ValueError(f"parallel.num_ranks={self.num_ranks} must be at least 1")
        if self.logical_nodes < 1 or self.num_ranks % self.logical_nodes:
            raise ValueError(f"parallel.logical_nodes={self.logical_nodes} must divide "
                             f"parallel.num_ranks={self.num_ranks}")
        if not self.store_timeout_s > 0:
            raise ValueError(f"parallel.store_timeout_s={self.store_timeout_s} must be > 0")
        if not self.collective_timeout_s >= 1:
            raise ValueError(f"parallel.collective_timeout_s={self.collective_timeout_s} must be at least 1 (seconds: "
                             f"a collective given less fails whenever a peer is a moment late)")


@dataclass
class ZeroConfig:
    """DeepSpeed ZeRO settings of the job."""

    stage: int = 2
    """ZeRO stage: 1, 2 or 3."""
    dtype: str = "fp32"
    """Weight/compute dtype: fp32, or bf16 (fp32 master weights under bf16 weights)."""
    reduce_bucket_size: int = 1_000_000
    """Elements per gradient-reduction bucket. DeepSpeed's 5e8 default allocates GBs per step on CPU."""
    allgather_bucket_size: int = 1_000_000
    """Elements per all-gather bucket (ZeRO 1/2)."""

    def __post_init__(self) -> None:
        check_choice("zero.stage", self.stage, (1, 2, 3))
        check_choice("zero.dtype", self.dtype, ("fp32", "bf16"))


@dataclass
class OptimizerConfig:
    """Which implementation of the JSON's AdamW DeepSpeed builds."""

    impl: str = "deepspeed"
    """deepspeed: DeepSpeed's own, what a config without ``torch_adam`` gets (FusedAdam; on CPU its
    fused_adam op); torch_adam: torch's AdamW (``"torch_adam": true``)."""

    def __post_init__(self) -> None:
        check_choice("optimizer.impl", self.impl, OPTIMIZER_IMPLS)


OPTIMIZER_IMPLS = ("deepspeed", "torch_adam")
LOOPS = ("steps", "own")


@dataclass
class TrainConfig:
    """The training loop's settings."""

    steps: int = 300
    """Optimizer steps to run."""
    seed: int = 1234
    """Seed for model init, dropout and the data sampler."""
    micro_batch: int = 8
    """Sequences per rank per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 disables)."""
    log_interval: int = 25
    """Steps between progress lines."""
    loop: str = "steps"
    """How the loop is written: ``steps`` (``for step in session.steps(total)``, the documented
    loop) or ``own`` (``while session.step_count() < total: train_step(session.step_count())``, a
    loop of the user's own around the resilient step; framework=deepspeed only)."""

    def __post_init__(self) -> None:
        check_choice("train.loop", self.loop, LOOPS)
        for key in ("steps", "micro_batch", "grad_accum", "log_interval"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key}={getattr(self, key)} must be at least 1")
        if not self.lr > 0:
            raise ValueError(f"train.lr={self.lr} must be > 0")
        for key in ("warmup_steps", "weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ValueError(f"train.{key}={getattr(self, key)} must be >= 0")


@dataclass
class FaultConfig:
    """A failure injected into the run (to watch a recovery)."""

    rank: int = -1
    """The rank SIGKILLed before the forward of ``step`` (-1: no failure)."""
    step: int = 0
    """The step (0-based) before which it dies."""


@dataclass
class GPTJobConfig:
    """The GPT smoke job: model, parallelism, ZeRO, loop, hotspare."""

    framework: str = "deepspeed"
    """The host: deepspeed (ZeRO data parallelism) or megatron (megatron-core pipeline stages x
    data parallelism with the distributed optimizer; ``parallel.pipeline_stages``)."""
    model: GPTConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    hotspare: HotspareConfig = field(default_factory=HotspareConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    corpus: str = ""
    """Text file to train on; empty uses the public-domain corpus the package ships."""
    out_dir: str = ""
    """Where run.json, per-rank results and summary.json go; empty uses Hydra's run directory."""

    def __post_init__(self) -> None:
        check_choice("framework", self.framework, FRAMEWORKS)
        if self.framework == "deepspeed":
            for key in ("pipeline_stages", "tensor_parallel", "virtual_stages"):
                if getattr(self.parallel, key) != 1:
                    raise ValueError(f"parallel.{key}={getattr(self.parallel, key)}: model parallelism is the "
                                     f"megatron path's (framework=megatron); DeepSpeed runs ZeRO data parallelism")
        if self.framework == "megatron":
            if self.train.loop != "steps":
                raise ValueError(f"train.loop={self.train.loop}: the megatron job's loop is session.steps(); "
                                 f"train.loop=own is framework=deepspeed's")
            if self.model.family != "gpt":
                raise ValueError(f"model.family={self.model.family}: framework=megatron builds megatron-core's GPTModel "
                                 f"from the shape; the transformers families run with framework=deepspeed")
            p = self.parallel
            if p.virtual_stages > 1 and p.pipeline_stages < 2:
                raise ValueError(f"parallel.virtual_stages={p.virtual_stages} needs parallel.pipeline_stages >= 2")
            if self.model.num_layers % (p.pipeline_stages * p.virtual_stages):
                raise ValueError(f"model.num_layers={self.model.num_layers} must be divisible by "
                                 f"parallel.pipeline_stages={p.pipeline_stages} x parallel.virtual_stages="
                                 f"{p.virtual_stages}")
            for key in ("num_heads", "vocab_size"):  # (the vocabulary: megatron-core's vocab-parallel embedding)
                if getattr(self.model, key) % p.tensor_parallel:
                    raise ValueError(f"model.{key}={getattr(self.model, key)} must be divisible by "
                                     f"parallel.tensor_parallel={p.tensor_parallel}")
            if p.virtual_stages > 1 and self.train.grad_accum % p.pipeline_stages:
                raise ValueError(f"train.grad_accum={self.train.grad_accum} (microbatches per iteration) must be a "
                                 f"multiple of parallel.pipeline_stages={p.pipeline_stages} for the interleaved "
                                 f"schedule (parallel.virtual_stages={p.virtual_stages})")
        f = self.fault
        if f.rank >= 0:
            if f.rank >= self.parallel.num_ranks:
                raise ValueError(f"fault.rank={f.rank} must be below parallel.num_ranks={self.parallel.num_ranks}")
            if not 0 <= f.step < self.train.steps:
                raise ValueError(f"fault.step={f.step} must be in [0, train.steps={self.train.steps})")
            if self.parallel.spares_per_node < 1 or not self.hotspare.enabled:
                raise ValueError(f"fault.rank={f.rank} kills a rank, but parallel.spares_per_node="
                                 f"{self.parallel.spares_per_node} and hotspare.enabled={self.hotspare.enabled}: the "
                                 f"job would just stop; start a spare (parallel.spares_per_node=1)")


def register(name: str = "gpt_job_schema") -> None:
    """Register the schema with Hydra so YAML under configs/ is checked against it."""
    cs = ConfigStore.instance()
    cs.store(name=name, node=GPTJobConfig)
    for group, node in (("model", GPTConfig), ("parallel", ParallelConfig), ("zero", ZeroConfig),
                        ("optimizer", OptimizerConfig), ("train", TrainConfig), ("fault", FaultConfig)):
        cs.store(group=group, name=f"{group}_schema", node=node)


def to_job(cfg) -> GPTJobConfig:
    """A typed, validated job from Hydra's config (OmegaConf already rejected unknown keys)."""
    data = OmegaConf.to_container(cfg, resolve=True)
    return from_mapping(GPTJobConfig, data)


def deepspeed_config(job: GPTJobConfig) -> dict:
    """The DeepSpeed JSON config the job implies, with its ``"hotspare"`` section."""
    t, z = job.train, job.zero
    cfg = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "weight_decay": t.weight_decay, "betas": [0.9, 0.95],
                                                  **({"torch_adam": True} if job.optimizer.impl == "torch_adam" else {})}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": t.lr,
                                                          "warmup_num_steps": t.warmup_steps,
                                                          "total_num_steps": max(t.steps, t.warmup_steps + 1)}},
        "zero_optimization": {"stage": z.stage, "reduce_bucket_size": z.reduce_bucket_size},
        "hotspare": to_mapping(job.hotspare),
    }
    if z.stage in (1, 2):
        cfg["zero_optimization"]["allgather_bucket_size"] = z.allgather_bucket_size
    else:
        cfg["zero_optimization"].update(stage3_prefetch_bucket_size=z.reduce_bucket_size,
                                        stage3_max_live_parameters=z.reduce_bucket_size,
                                        stage3_max_reuse_distance=z.reduce_bucket_size)
    if z.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def launch(job: GPTJobConfig, out_dir: str, extra_env: dict | None = None, *, worker: str | None = None,
           spares_per_node: int | None = None, keeper: bool = True, **worker_options) -> int:
    """Write run.json and run the job's ranks under hotspare-run; return the launcher's exit code
    (:func:`launch_spec` says what the arguments mean)."""
    return run(launch_spec(job, out_dir, extra_env, worker=worker, spares_per_node=spares_per_node, keeper=keeper,
                           **worker_options))


def launch_spec(job: GPTJobConfig, out_dir: str, extra_env: dict | None = None, *, worker: str | None = None,
                spares_per_node: int | None = None, keeper: bool = True, **worker_options) -> LaunchSpec:
    """Write run.json and return the hotspare-run spec that runs the job's ranks.

    ``worker_options`` go to job_worker.py's run.json as is: ``mode`` ('train', 'hotspare',
    'restart'), ``verify_mirror`` (record digests of every live and mirrored version),
    ``mirror_block`` (alternate blocks of steps off and on), the faults (see the worker).
    Events go to ``out_dir/events`` unless ``hotspare.events_dir`` says otherwise.
    """
    os.makedirs(out_dir, exist_ok=True)
    if worker is None:
        worker = WORKER
    ds = deepspeed_config(job)
    if job.hotspare.enabled and not job.hotspare.events_dir:
        ds["hotspare"]["events_dir"] = os.path.join(out_dir, "events")
    if spares_per_node is None:
        spares_per_node = job.parallel.spares_per_node
    run_cfg = {"model": to_mapping(job.model), "train": to_mapping(job.train), "deepspeed": ds,
               "corpus": job.corpus, "out_dir": out_dir, "fault": to_mapping(job.fault) if job.fault.rank >= 0 else None,
               "collective_timeout_s": job.parallel.collective_timeout_s, "framework": job.framework,
               "pipeline_stages": job.parallel.pipeline_stages, "tensor_parallel": job.parallel.tensor_parallel,
               "virtual_stages": job.parallel.virtual_stages, **worker_options}
    path = os.path.join(out_dir, "run.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(run_cfg, f, indent=1)
    spec = LaunchSpec(script=[worker, "--config", path], nproc_per_node=job.parallel.num_ranks,
                      logical_nodes=job.parallel.logical_nodes, store_timeout_s=job.parallel.store_timeout_s,
                      spares_per_node=spares_per_node, keeper=keeper, successor_wait_s=job.parallel.successor_wait_s,
                      extra_env={"OMP_NUM_THREADS": "1", **(extra_env or {})})
    return spec


def collect(out_dir: str, num_ranks: int) -> list[dict]:
    """Per-rank results written by the workers, in rank order."""
    found = ranks_of(out_dir)
    for r in range(num_ranks):
        if r not in found:
            raise RuntimeError(f"rank {r} wrote no result ({os.path.join(out_dir, f'rank{r}.json')}); see its "
                               f"output above")
    return [found[r] for r in range(num_ranks)]


def summarize(results: list[dict], wall_s: float) -> dict:
    """The job summary: loss at start and end (mean over ranks), throughput, digests."""
    steps = results[0]["steps"]
    k = max(1, min(10, steps // 10))
    # A spare's record starts at the step it landed on, a megatron rank off the last stage has none:
    # each step's mean is over the ranks that have it.
    mean_loss = [statistics.fmean(float.fromhex(r["losses"][str(i)]) for r in results if str(i) in r["losses"])
                 for i in range(steps)]
    step_s = statistics.median(r["step_s_median"] for r in results)
    return {
        "steps": steps, "num_ranks": len(results), "framework": results[0].get("framework", "deepspeed"),
        "zero_stage": results[0]["zero_stage"], "pipeline_stages": 1 + max(r.get("pipeline_stage", 0) for r in results),
        "tensor_parallel": 1 + max(r.get("tensor_parallel_rank", 0) for r in results),
        "virtual_stages": max(r.get("chunks", 1) for r in results),
        # megatron: each rank counts its stage's parameters, those replicated across tensor-parallel
        # ranks on its first one only (data-parallel rank 0 of each stage adds up).
        "num_params": (results[0]["num_params"] if "pipeline_stage" not in results[0] else
                       sum(r["num_params"] for r in results if r["data_parallel_rank"] == 0)),
        "loss_first": statistics.fmean(mean_loss[:k]), "loss_last": statistics.fmean(mean_loss[-k:]),
        "step_s_median": step_s, "tokens_per_s": results[0]["tokens_per_step"] / step_s,
        "wall_s": wall_s,
        "fp32_digests": [r["fp32_digest"] for r in results],
        "optimizer_digests": [r["optimizer_digest"] for r in results],
    }


def megatron_layout(s: dict) -> str:
    pp, tp, vp = s["pipeline_stages"], s.get("tensor_parallel", 1), s.get("virtual_stages", 1)
    return (f"{pp} pipeline stages{f' ({vp} virtual each, interleaved)' if vp > 1 else ''} x "
            f"{f'{tp} tensor-parallel x ' if tp > 1 else ''}{s['num_ranks'] // (pp * tp)} data-parallel, "
            f"distributed optimizer")


def print_summary(s: dict, file=sys.stdout) -> None:
    layout = (("ZeRO stage", s["zero_stage"]) if s.get("framework", "deepspeed") == "deepspeed" else
              ("megatron-core", megatron_layout(s)))
    rows = [("steps", s["steps"]), ("ranks", s["num_ranks"]), layout,
            ("parameters", f"{s['num_params']:,}"),
            ("loss (first/last 10%)", f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}"),
            ("median step", f"{s['step_s_median'] * 1e3:.1f} ms"), ("tokens/s", f"{s['tokens_per_s']:,.0f}"),
            ("wall time", f"{s['wall_s']:.1f} s"), ("rank 0 fp32 digest", s["fp32_digests"][0][:16])]
    width = max(len(k) for k, _ in rows)
    print("summary", file=file)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}", file=file)
