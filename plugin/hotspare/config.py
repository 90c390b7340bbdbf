"""Typed, strictly validated configuration.

Each component owns a dataclass; its fields (with their one-line docstrings) are the schema.
``from_mapping`` builds one from a plain mapping -- the ``"hotspare"`` section of a
DeepSpeed JSON config, or a Hydra/OmegaConf node -- and rejects unknown keys and wrong
types with an error that names the key and what is allowed. Nothing is silently dropped.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

from .errors import HotspareError

T = TypeVar("T")

DEEPSPEED_SECTION = "hotspare"


class ConfigError(HotspareError, ValueError):
    """A configuration value or key is wrong; the message names it and says what is allowed."""


IN_FLIGHT_POLICIES = ("wait", "skip")
TIER2_KINDS = ("mirror", "stripe")


@dataclass
class MirrorConfig:
    """Per-iteration copies of each rank's unique state in peers on other nodes."""

    enabled: bool = True
    """Mirror every optimizer step (off: no copies, no per-step cost)."""
    replicas: int = 1
    """Peers (on other nodes) that hold a copy of each rank's unique state."""
    in_flight: str = "wait"
    """When the previous copy is still in flight at the next step: 'wait' for it, or 'skip' this version."""
    chunk_mb: float = 4.0
    """Size of each transfer message in MiB."""
    timeout_s: float = 60.0
    """Longest wait for one transfer before the mirror reports its peer as failed."""

    def __post_init__(self) -> None:
        check_choice("mirror.in_flight", self.in_flight, IN_FLIGHT_POLICIES)
        if self.replicas < 0:
            raise ConfigError(f"mirror.replicas={self.replicas} must be >= 0 (0 turns mirroring off)")
        if not self.chunk_mb > 0:
            raise ConfigError(f"mirror.chunk_mb={self.chunk_mb} must be > 0")
        if not self.timeout_s > 0:
            raise ConfigError(f"mirror.timeout_s={self.timeout_s} must be > 0")

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * (1 << 20)))


@dataclass
class RecoveryConfig:
    """In-place recovery: detection timeouts and the rebuild's limits.

    The timeouts form one hierarchy, checked at start-up: a heartbeat is sent every
    ``heartbeat_interval_s``; a worker silent for ``heartbeat_timeout_s`` is declared hung
    and killed by its launcher (which breaks its sockets, so its peers' collectives fail at
    once); ``collective_timeout_s`` is only the backstop for a collective that neither
    completes nor fails, so it must be longer than the heartbeat timeout.
    """

    enabled: bool = True
    """Recover failed ranks in place with a spare (off: a failure stops the job, as without hotspare)."""
    heartbeat_interval_s: float = 0.5
    """Seconds between a worker's heartbeats to the control store."""
    heartbeat_timeout_s: float = 10.0
    """Silence after which a worker is declared hung and killed by its launcher."""
    collective_timeout_s: float = 120.0
    """Timeout of every process group hotspare creates (the backstop for a hang)."""
    rendezvous_timeout_s: float = 60.0
    """Longest wait for the coordinator's plan and for the new generation's members."""
    max_recoveries: int = 16
    """Recoveries after which the job stops instead (a failure that recurs is not a transient fault)."""

    def __post_init__(self) -> None:
        for key in ("heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_s", "rendezvous_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"recovery.{key}={getattr(self, key)} must be > 0")
        if not self.heartbeat_timeout_s >= 2 * self.heartbeat_interval_s:
            raise ConfigError(f"recovery.heartbeat_timeout_s={self.heartbeat_timeout_s} must be at least twice "
                              f"recovery.heartbeat_interval_s={self.heartbeat_interval_s}, or one late beat "
                              f"kills a healthy worker")
        if not self.collective_timeout_s > self.heartbeat_timeout_s:
            raise ConfigError(f"recovery.collective_timeout_s={self.collective_timeout_s} must be longer than "
                              f"recovery.heartbeat_timeout_s={self.heartbeat_timeout_s}: a hung peer is found by "
                              f"its missing heartbeats, and a collective must not give up first")
        if self.max_recoveries < 0:
            raise ConfigError(f"recovery.max_recoveries={self.max_recoveries} must be >= 0")


@dataclass
class CheckpointConfig:
    """Persistent checkpoints: the last tier, loaded only when every in-memory copy of some rank's
    state is lost (a rank and all its mirror holders died together). DeepSpeed's own checkpoint
    files, or megatron-core's ``dist_checkpointing`` ones."""

    dir: str = ""
    """Directory every node can read (shared storage: a spare may load another node's rank); empty: off."""
    every: int = 0
    """Optimizer steps between saves (0: off). DeepSpeed: written by a background thread, off the
    critical path; megatron-core: written by ``dist_checkpointing.save`` on the training thread."""
    keep: int = 2
    """Newest complete checkpoints kept; older ones (and incomplete ones older than them) are deleted."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every={self.every} must be >= 0 (0 turns saving off)")
        if self.every > 0 and not self.dir:
            raise ConfigError(f"checkpoint.every={self.every} needs checkpoint.dir: the directory the checkpoints "
                              f"go to (shared by every node)")
        if self.dir and self.every == 0:
            raise ConfigError(f"checkpoint.dir={self.dir!r} is set but checkpoint.every is 0: say how many steps "
                              f"apart the checkpoints are, or leave checkpoint.dir empty")
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep={self.keep} must be at least 1")

    @property
    def enabled(self) -> bool:
        return self.every > 0


@dataclass
class RetainConfig:
    """Retention outside the trainer process: each rank's own snapshots live in its node's keeper
    (shared memory that outlives the trainer), so a spare on the same node takes over a crashed
    rank with no network transfer of its state. Rides on the mirror's per-step capture
    (``mirror.enabled``); with ``mirror.replicas=0`` the keeper is the only copy."""

    keeper: bool = True
    """Keep this rank's snapshots in its node's keeper (needs hotspare-run, which starts the keepers)."""
    budget_mb: float = 0.0
    """Host memory this node's keeper may give retained state, in MiB (0: only /dev/shm's free space
    bounds it). Over it, a rank keeps only its newest version, then none; the log says which."""
    tier2: str = "mirror"
    """Protection across nodes: 'mirror' (mirror.replicas full copies on other nodes) or 'stripe'
    (zfec: k data + m parity shares of each rank's state on k+m distinct nodes)."""
    k: int = 2
    """Stripe: data shares each rank's state is cut into (memory (k+m)/k of the state)."""
    m: int = 1
    """Stripe: parity shares; the state survives the loss of any m whole nodes, keepers included."""
    device_tier: bool = False
    """CUDA only: the keeper also keeps a copy of each rank's newest capture on the rank's GPU
    (memory the keeper owns, shared by IPC handle), so a spare taking a crashed rank on the same
    GPU restores at device speed instead of copying the state from host memory. Costs one more
    copy of the unique state in GPU memory, and the keeper a CUDA context per GPU."""

    def __post_init__(self) -> None:
        if self.device_tier and not self.keeper:
            raise ConfigError("retain.device_tier=true needs retain.keeper=true (the keeper owns the device copy)")
        if self.budget_mb < 0:
            raise ConfigError(f"retain.budget_mb={self.budget_mb} must be >= 0 (0: no budget)")
        check_choice("retain.tier2", self.tier2, TIER2_KINDS)
        if self.tier2 == "stripe":
            if self.k < 1:
                raise ConfigError(f"retain.k={self.k} must be at least 1 (the data shares of a stripe)")
            if self.m < 1:
                raise ConfigError(f"retain.m={self.m} with retain.tier2='stripe': m=0 parity shares survive no node "
                                  f"loss; use m >= 1, or tier2='mirror'")
            if self.k + self.m > 256:
                raise ConfigError(f"retain.k+retain.m={self.k + self.m} must be at most 256 (zfec's limit)")

    def check_nodes(self, num_nodes: int) -> None:
        """At start-up, once the job's node count is known."""
        if self.tier2 == "stripe" and self.k + self.m > num_nodes:
            raise ConfigError(f"retain.k={self.k} + retain.m={self.m} = {self.k + self.m} shares need as many nodes, "
                              f"the job has {num_nodes}: lower k or m, add nodes, or use retain.tier2='mirror'")

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_mb * (1 << 20))


@dataclass
class StragglersConfig:
    """Slow ranks (hotspare.stragglers): each rank's compute time per step (its forward) is
    compared with its peers'; a rank slower than ``factor`` times their median in each of
    ``window`` consecutive steps is handed to a ready spare at a step boundary, with no lost
    iteration. Off by default: a handover spends a spare and a recovery's pause."""

    enabled: bool = False
    """Detect stragglers and hand them to spares (off: no timing, no handover)."""
    factor: float = 1.5
    """How many times its peers' median compute time a rank must take to count as slow (> 1)."""
    window: int = 5
    """Consecutive steps a rank must be slow in (2 to 32: one slow step is a pause, not a straggler)."""

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ConfigError(f"stragglers.factor={self.factor} must be > 1 (a rank as fast as its peers is not slow)")
        if self.window < 2:
            raise ConfigError(f"stragglers.window={self.window} must be at least 2: one slow step (a garbage "
                              f"collection, a checkpoint write) must not hand a rank over")
        if self.window > 32:
            raise ConfigError(f"stragglers.window={self.window} must be at most 32 (the compute times a worker "
                              f"sends with its heartbeat)")


@dataclass
class HotspareConfig:
    """The ``"hotspare"`` section of a DeepSpeed JSON config."""

    enabled: bool = True
    """Turn hotspare on. With false every hook is a no-op and training is plain DeepSpeed."""
    events_dir: str = ""
    """Directory for the JSON-lines event log (one file per rank); empty disables the log."""
    mirror: MirrorConfig = field(default_factory=MirrorConfig)
    """Peer mirroring of unique state (FFTrainer-style neighbouring redundancy)."""
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """Failure detection and in-place recovery."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Persistent checkpoints, the fallback when redundancy is exhausted."""
    retain: RetainConfig = field(default_factory=RetainConfig)
    """Retention in the node's keeper (tier 1, survives a trainer crash)."""
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
    """Slow ranks found and handed to spares."""


def check_choice(key: str, value: Any, allowed: tuple) -> None:
    """Raise ConfigError unless ``value`` is one of ``allowed`` (schemas use this instead of Literal,
    which OmegaConf cannot type)."""
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not allowed; expected one of {', '.join(map(repr, allowed))}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return f"a mapping for {tp.__name__}"
    if origin in (list, tuple):
        (item, *_) = typing.get_args(tp) or (Any,)
        return f"a list of {_type_name(item)}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` checked against type ``tp``; raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return from_mapping(tp, value, prefix=key)
    if origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        out = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    # bool is a subclass of int: never accept true for a count, nor 1 for a switch.
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"config schema field {key} has unsupported type {tp!r}")


def from_mapping(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, strictly: unknown keys and wrong types raise."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key{hint}; allowed keys: {', '.join(sorted(fields))}")
        kwargs[key] = _coerce(value, hints[key], path)
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix or cls.__name__}: missing required key(s) {', '.join(missing)}")
    try:
        obj = cls(**kwargs)
    except ConfigError as exc:  # a component's own check names its key: give it the full path
        raise ConfigError(_with_prefix(prefix, str(exc))) from None
    except ValueError as exc:
        raise ConfigError(f"{prefix or cls.__name__}: {exc}") from exc
    return obj


def _with_prefix(prefix: str, message: str) -> str:
    """'mirror.replicas: ...' raised inside hotspare.mirror becomes 'hotspare.mirror.replicas: ...'."""
    if not prefix or message.startswith(prefix + "."):
        return message
    head = prefix.rsplit(".", 1)[-1]
    return f"{prefix}{message[len(head):]}" if message.startswith(head + ".") else message


def to_mapping(obj: Any) -> dict[str, Any]:
    """Plain-dict form of a config dataclass (JSON-serialisable)."""
    return dataclasses.asdict(obj)


def load_json_file(path: str, what: str):
    """The JSON document in ``path``; a ConfigError naming ``what``, the file and, when it does not
    parse, the line and column."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        where = f" at line {exc.lineno}, column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise ConfigError(f"{what} {path}: not JSON{where} ({getattr(exc, 'msg', exc)})") from None


def split_deepspeed_config(ds_config: Mapping[str, Any] | str) -> tuple[dict[str, Any], HotspareConfig | None]:
    """Split a DeepSpeed config (dict or JSON path) into (DeepSpeed part, validated hotspare section).

    Returns ``None`` for the section when the config has none: hotspare is then off.
    """
    if isinstance(ds_config, str):
        ds_config = load_json_file(ds_config, "DeepSpeed config")
    if not isinstance(ds_config, Mapping):
        raise ConfigError(f"DeepSpeed config must be a mapping or a JSON file path, got {type(ds_config).__name__}")
    rest = {k: v for k, v in ds_config.items() if k != DEEPSPEED_SECTION}
    if DEEPSPEED_SECTION not in ds_config:
        return rest, None
    return rest, from_mapping(HotspareConfig, ds_config[DEEPSPEED_SECTION], prefix=DEEPSPEED_SECTION)
