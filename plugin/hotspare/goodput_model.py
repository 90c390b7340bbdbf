"""The goodput simulator's model: failure classes and rates, the job and its hardware, the
measured recovery terms and each strategy's parameters, as a typed config (``docs/goodput.md``);
what one failure costs each strategy is :mod:`hotspare.goodput_costs`.

No torch, no processes. Every default is either a published figure or a measurement of this
project, or is labelled an assumption in ``configs/simulate_goodput.yaml``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hotspare.config import ConfigError, check_choice

STRATEGIES = ("checkpoint_restart", "gemini_like", "fftrainer_like", "leto_like", "hotspare")
TERMS = ("detection", "rebuild", "restore", "recompute", "restart", "overhead", "waiting")
RECOVERY_KINDS = ("process", "node", "network")
DETECTORS = ("crash", "heartbeat", "collective")
REBUILD_GROWTH = ("log", "linear")
SECONDS_PER_DAY = 86400.0
GB = 1e9


@dataclass
class FailureClass:
    """One class of interruptions: how often it strikes and how a strategy must recover from it."""

    name: str
    """Label used in the output."""
    interruptions: float
    """Interruptions of this class in the reference snapshot (failures.reference_*)."""
    recovery: str
    """'process' (a process or software fault; the hardware survives), 'node' (a GPU or host is lost:
    the node is replaced) or 'network' (a transient fabric fault: every worker survives)."""
    detect: str
    """How the fault is seen: 'crash' (a process exits or raises), 'heartbeat' (a silent host: the
    heartbeat timeout) or 'collective' (a hang: the collective timeout)."""
    components: list[str] = field(default_factory=list)
    """The source's components grouped here (documentation only)."""


def llama3_classes() -> list[FailureClass]:
    """Llama 3 405B, 54 days on 16,384 H100s: 419 unexpected interruptions (Dubey et al., arXiv
    2407.21783, Table 5), grouped into the three recovery classes (see configs/simulate_goodput.yaml)."""
    return [
        FailureClass("software", 56, "process", "crash", ["software bug 54", "dependency 2"]),
        FailureClass("hang", 7, "process", "collective", ["NCCL watchdog timeouts 7"]),
        FailureClass("gpu", 268, "node", "crash", ["faulty GPU 148", "GPU HBM3 72", "GPU SRAM 19",
                                                   "GPU system processor 17", "silent data corruption 6",
                                                   "GPU thermal interface + sensor 6"]),
        FailureClass("host", 53, "node", "heartbeat", ["host maintenance 32", "NIC 7", "SSD 3", "power supply 3",
                                                       "server chassis 2", "IO expansion board 2", "CPU 2",
                                                       "system memory 2"]),
        FailureClass("network", 35, "network", "heartbeat", ["network switch/cable 35"]),
    ]


@dataclass
class FailureModel:
    """Failure rates: a reference snapshot's counts, turned into a constant per-GPU rate."""

    reference_gpus: int = 16384
    """GPUs of the job the counts were observed on."""
    reference_days: float = 54.0
    """Length of the observation."""
    rate_scale: float = 1.0
    """Multiplier on every class's rate (sensitivity: other clusters fail more often)."""
    classes: list[FailureClass] = field(default_factory=llama3_classes)
    """The failure classes; at least one with interruptions > 0."""

    def __post_init__(self) -> None:
        if self.reference_gpus < 1 or not self.reference_days > 0:
            raise ConfigError(f"failures.reference_gpus={self.reference_gpus} and failures.reference_days="
                              f"{self.reference_days} must be positive")
        if self.rate_scale < 0:
            raise ConfigError(f"failures.rate_scale={self.rate_scale} must be >= 0")
        for i, c in enumerate(self.classes):
            check_choice(f"failures.classes[{i}].recovery", c.recovery, RECOVERY_KINDS)
            check_choice(f"failures.classes[{i}].detect", c.detect, DETECTORS)
            if c.interruptions < 0:
                raise ConfigError(f"failures.classes[{i}].interruptions={c.interruptions} must be >= 0")
        if not self.classes:
            raise ConfigError("failures.classes is empty: give at least one failure class")

    def rates_per_gpu_s(self) -> list[float]:
        """Each class's rate per GPU-second; constant in time and linear in the GPU count."""
        gpu_s = self.reference_gpus * self.reference_days * SECONDS_PER_DAY
        return [self.rate_scale * c.interruptions / gpu_s for c in self.classes]

    def mtbf_s(self, num_gpus: int) -> float:
        """Mean time between interruptions of a job on ``num_gpus`` GPUs (inf when nothing fails)."""
        rate = sum(self.rates_per_gpu_s()) * num_gpus
        return math.inf if rate == 0 else 1.0 / rate


@dataclass
class JobModel:
    """The training job and the hardware it runs on."""

    gpus_per_node: int = 8
    """GPUs per node: the unit a GPU or host loss takes out."""
    tensor_parallel: int = 8
    """TP degree; data parallelism is num_gpus / (TP * PP)."""
    pipeline_parallel: int = 16
    """PP degree."""
    model_params: float = 405e9
    """Parameters of the model (fixed at every GPU count: the batch grows with data parallelism)."""
    unique_bytes_per_param: float = 12.15
    """Unique state per parameter over all ranks (fp32 master + Adam moments + small rest)."""
    checkpoint_bytes_per_param: float = 14.0
    """Bytes per parameter of a persistent checkpoint (unique state plus bf16 weights)."""
    iteration_s: float = 6.2
    """Seconds per training iteration, at every GPU count (weak scaling)."""
    nic_gbps: float = 400.0
    """Network bandwidth per GPU, Gbit/s."""
    host_link_gbs: float = 25.0
    """Effective device-host copy bandwidth per GPU, GB/s, with a node's GPUs copying at once."""
    storage_write_gbs: float = 2000.0
    """Aggregate write bandwidth of the checkpoint storage, GB/s."""
    storage_read_gbs: float = 2000.0
    """Aggregate read bandwidth of the checkpoint storage, GB/s."""

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "tensor_parallel", "pipeline_parallel"):
            if getattr(self, key) < 1:
                raise ConfigError(f"job.{key}={getattr(self, key)} must be at least 1")
        for key in ("model_params", "unique_bytes_per_param", "checkpoint_bytes_per_param", "iteration_s",
                    "nic_gbps", "host_link_gbs", "storage_write_gbs", "storage_read_gbs"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"job.{key}={getattr(self, key)} must be > 0")

    def check_gpus(self, num_gpus: int, key: str = "num_gpus") -> None:
        unit = math.lcm(self.tensor_parallel * self.pipeline_parallel, self.gpus_per_node)
        if num_gpus < unit or num_gpus % unit:
            raise ConfigError(f"{key}={num_gpus} must be a positive multiple of {unit} (job.tensor_parallel * "
                              f"job.pipeline_parallel and job.gpus_per_node)")


@dataclass
class MeasuredWay:
    """One in-place way's recovery terms as recipes/bench_recovery.py measured them."""

    detect_s: float
    """Fault to the survivors' first error."""
    rebuild_s: float
    """Group re-creation with the spare (at the benchmark's rank count)."""
    restore_s: float
    """Restore of the state, fixed part (a tiny model: protocol, checksums)."""


@dataclass
class Measured:
    """This project's own measurements: the base of the scaling model (docs/recovery.md,
    docs/retention.md), or a recipes/bench_recovery.py JSON (simulate_goodput's ``calibration``)."""

    num_ranks: int = 4
    """Ranks of the benchmark job the terms were measured on."""
    keeper: MeasuredWay = field(default_factory=lambda: MeasuredWay(0.06, 0.09, 0.03))
    """Spare on the dead rank's node, state from its keeper (process faults)."""
    peers: MeasuredWay = field(default_factory=lambda: MeasuredWay(0.05, 0.08, 0.03))
    """Spare restores from a peer's mirror over the network (node loss, tier 2 mirror)."""
    stripe: MeasuredWay = field(default_factory=lambda: MeasuredWay(0.09, 0.10, 0.03))
    """Whole node lost, state decoded from zfec shares (node loss, tier 2 stripe)."""
    capture_s: float = 0.0011
    """Per-step copy of the unique state on the training thread, fixed part."""

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ConfigError(f"measured.num_ranks={self.num_ranks} must be at least 1")
        for way in ("keeper", "peers", "stripe"):
            for key in ("detect_s", "rebuild_s", "restore_s"):
                if getattr(getattr(self, way), key) < 0:
                    raise ConfigError(f"measured.{way}.{key}={getattr(getattr(self, way), key)} must be >= 0")
        if self.capture_s < 0:
            raise ConfigError(f"measured.capture_s={self.capture_s} must be >= 0")


@dataclass
class CostModel:
    """How the measured terms and the restart grow on a cluster; timeouts; cold starts."""

    heartbeat_timeout_s: float = 10.0
    """Detection of a silent host or a fabric fault (hotspare's recovery.heartbeat_timeout_s)."""
    collective_timeout_s: float = 120.0
    """Detection of a hang (hotspare's recovery.collective_timeout_s)."""
    rebuild_growth: str = "log"
    """Group creation at N GPUs: 'log' (base + per doubling) or 'linear' (base + per GPU)."""
    rebuild_per_doubling_s: float = 2.5
    """'log': seconds added each time the GPU count doubles past the benchmark's."""
    rebuild_per_gpu_s: float = 0.0024
    """'linear': seconds added per GPU."""
    job_restart_s: float = 300.0
    """Restart-based strategies: tear down, reschedule and start every process up to training,
    group creation and state load excluded (they are the rebuild and restore terms)."""
    node_allocate_s: float = 60.0
    """The scheduler hands the job a healthy node from the cluster's free pool."""
    process_start_s: float = 30.0
    """Cold start of a node's (or one rank's) processes: imports, accelerator context, model build."""
    mirror_interference: float = 1.0
    """Share of the mirror's (or in-memory checkpoint's) network time that slows the step."""
    copy_overlapped: bool = False
    """hotspare only: its device-to-host copy as built on GPUs, on a stream of its own
    (docs/gpu.md: 1 GiB cost the training thread 1.06 ms on an H200), so a step pays
    ``measured.capture_s`` and waits for the copy only where it outlasts the iteration. False
    (the default) charges the whole copy to every step: an upper bound that also covers the
    copy's contention for memory and the host link, which no measurement here bounds."""

    def __post_init__(self) -> None:
        check_choice("costs.rebuild_growth", self.rebuild_growth, REBUILD_GROWTH)
        for key in ("heartbeat_timeout_s", "collective_timeout_s", "rebuild_per_doubling_s", "rebuild_per_gpu_s",
                    "job_restart_s", "node_allocate_s", "process_start_s", "mirror_interference"):
            if getattr(self, key) < 0:
                raise ConfigError(f"costs.{key}={getattr(self, key)} must be >= 0")


@dataclass
class CheckpointRestartModel:
    """Checkpoint to storage, restart the job on every failure."""

    interval_s: float = 0.0
    """Compute seconds between checkpoints; 0: Young's optimum sqrt(2 * C * MTBF)."""
    checkpoint_fixed_s: float = 0.0
    """Blocking cost of a checkpoint beyond its bytes over the storage bandwidth."""

    def __post_init__(self) -> None:
        if self.interval_s < 0 or self.checkpoint_fixed_s < 0:
            raise ConfigError(f"checkpoint_restart.interval_s={self.interval_s} and checkpoint_restart."
                              f"checkpoint_fixed_s={self.checkpoint_fixed_s} must be >= 0")


@dataclass
class GeminiModel:
    """Gemini-like: checkpoints in CPU memory (own node and a peer), restart on every failure."""

    every_iterations: int = 1
    """Iterations between in-memory checkpoints."""
    replicas: int = 1
    """Copies on other nodes' CPU memory."""

    def __post_init__(self) -> None:
        if self.every_iterations < 1 or self.replicas < 1:
            raise ConfigError(f"gemini_like.every_iterations={self.every_iterations} and gemini_like.replicas="
                              f"{self.replicas} must be at least 1")


@dataclass
class InPlaceModel:
    """hotspare, and the Leto-like design: survivors keep their processes; state retained."""

    tier2: str = "mirror"
    """Protection across nodes: 'mirror' (full copies) or 'stripe' (zfec k + m shares)."""
    keeper: bool = True
    """A per-node keeper retains each rank's state: process faults restore locally."""
    replicas: int = 1
    """tier2 'mirror': copies on other nodes."""
    k: int = 2
    """tier2 'stripe': data shares."""
    m: int = 1
    """tier2 'stripe': parity shares."""
    spare_nodes_per_1024_gpus: float = 1.0
    """Hot spare nodes held per 1,024 GPUs (rounded up; 0: none, cold replacement on node loss)."""
    spare_replenish_s: float = 3600.0
    """From a node loss until a replacement joins the spare pool (allocation, health check, start)."""

    def check(self, section: str) -> None:
        """Raise ConfigError naming ``section.key`` (the same schema serves two sections)."""
        check_choice(f"{section}.tier2", self.tier2, ("mirror", "stripe"))
        for key in ("replicas", "k", "m"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{section}.{key}={getattr(self, key)} must be at least 1 (tier 2 must survive "
                                  f"a node loss)")
        for key in ("spare_nodes_per_1024_gpus", "spare_replenish_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{section}.{key}={getattr(self, key)} must be >= 0")


def _leto_default() -> InPlaceModel:
    return InPlaceModel(tier2="stripe", keeper=True, spare_nodes_per_1024_gpus=0.0)


@dataclass
class GoodputModel:
    """Everything the cost of a failure depends on."""

    failures: FailureModel = field(default_factory=FailureModel)
    """Failure classes and rates."""
    job: JobModel = field(default_factory=JobModel)
    """The job and its hardware."""
    measured: Measured = field(default_factory=Measured)
    """hotspare's measured recovery terms (the scaling model's base)."""
    costs: CostModel = field(default_factory=CostModel)
    """Growth with N, timeouts, restarts, cold starts."""
    checkpoint_restart: CheckpointRestartModel = field(default_factory=CheckpointRestartModel)
    """Checkpoint-restart to storage."""
    gemini_like: GeminiModel = field(default_factory=GeminiModel)
    """In-memory checkpoints with restart."""
    leto_like: InPlaceModel = field(default_factory=_leto_default)
    """In place, retained state, stripes, no hot spares (spare_nodes_per_1024_gpus is ignored: 0)."""
    hotspare: InPlaceModel = field(default_factory=InPlaceModel)
    """In place with keeper, mirror or stripe, and a pool of hot spare nodes."""

    def __post_init__(self) -> None:
        self.leto_like.check("leto_like")
        self.hotspare.check("hotspare")
