"""The fault matrix's cases and verdicts, and the chaos soak's schedule (the runners are
``recipes/fault_matrix.py`` and ``recipes/chaos.py``; docs/faults.md).

A case is ``FRAMEWORK/FAULT[+FAULT...]`` (faults in :mod:`hotspare.testing.faults`' notation);
:func:`product` lists the cases a config selects, :func:`classify` turns one run's exit code,
output and per-rank results into its outcome against an uninterrupted run.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from ..config import ConfigError, from_mapping
from ..launch import ABORT_EXIT_CODE
from . import faults as catalogue
from .job import GPTJobConfig
from .probes import FAMILIES, WAYS

FRAMEWORKS = ("zero1", "zero2", "zero3", "megatron")
HOST_FAULTS = ("cut", "slow", "node", "blip", "launcher0", "launcher1", "keeper")
SLOW_MBIT = 20.0
"""The slow link's rate: a step's collectives and mirror copy take about a second on it."""
TARGETS = ("first", "middle", "last", "spare")
OUTCOMES = ("recovered", "handed_over", "fell_back", "stopped_cleanly", "unaffected", "wrong", "hung", "crashed")
ACCEPTABLE = ("recovered", "handed_over", "fell_back", "stopped_cleanly", "unaffected")
STRAGGLER_FRAMEWORKS = ("zero1", "zero2", "zero3", "megatron")
"""Every framework: ZeRO 3's compute time is its leaf modules' (after their parameters arrived)."""
SLOWDOWN = 3
"""The straggler cases' rank computes this many times slower (``slow@forward:R:S:3``)."""
CONTROL_PROBES = ("unsigned:all", "forged:all", "malformed:all", "forged:all+kill", "malformed:all+kill", "replay",
                  "hole", "second_job", "second_node0", "kill_keeper", "kill_launcher")
"""A stranger on the store's port (:mod:`.probes`): ``WAY:FAMILIES[+kill]`` writes into key
families (``all``, or one of probes.FAMILIES, ``/``-separated) a well-formed value with no
signature (unsigned), one signed with the stranger's own secret (forged), or one that looks signed
over text that does not parse (malformed); ``+kill`` then SIGKILLs the last rank, so that the
values read only during a recovery are read. replay: the job's own signed values copied back later
or under other names. hole: each list's public counter moved with no entry written. second_job:
another hotspare-run (another secret) joins as node 1; second_node0: another single-node
hotspare-run on the same port. kill_keeper: node 0's keeper SIGKILLed; kill_launcher:
hotspare-run SIGKILLed (nothing of the job may be alive 15 s later)."""
PROBE_KILL_STEP = 20
"""The step before whose forward a ``+kill`` probe kills the last rank (the probe lands at the
first step; control_steps is 40)."""


def parse_probe(text: str) -> tuple[str, tuple[str, ...], bool]:
    """``WAY:FAMILIES[+kill]`` -> (way, families, kill); ('replay', (), False) and the like for
    the named probes; ConfigError naming the text otherwise."""
    body, kill = (text[:-5], True) if text.endswith("+kill") else (text, False)
    if ":" not in body:
        if body not in CONTROL_PROBES or kill:
            raise ConfigError(f"control_probes: {text!r} is not WAY:FAMILIES[+kill] (WAY one of "
                              f"{', '.join(WAYS)}) nor one of {', '.join(p for p in CONTROL_PROBES if ':' not in p)}")
        return body, (), False
    way, _, names = body.partition(":")
    families = FAMILIES if names == "all" else tuple(names.split("/"))
    bad = [f for f in families if f not in FAMILIES]
    if way not in WAYS or bad or not families:
        raise ConfigError(f"control_probes: {text!r}: WAY is one of {', '.join(WAYS)} and FAMILIES 'all' or "
                          f"'/'-separated names of {', '.join(FAMILIES)}")
    return way, families, kill


@dataclass
class FaultMatrixConfig(GPTJobConfig):
    """The GPT job plus which cases of the matrix to run."""

    out: str = "fault_matrix.json"
    """Where the JSON result goes."""
    frameworks: list[str] = field(default_factory=lambda: list(FRAMEWORKS))
    """Hosts: zero1, zero2, zero3 (DeepSpeed) and megatron (PP=2 x DP=2)."""
    kinds: list[str] = field(default_factory=lambda: list(catalogue.KINDS))
    """Fault kinds (hotspare.testing.faults.KINDS)."""
    phases: list[str] = field(default_factory=lambda: list(catalogue.PHASES))
    """Phases (each kind runs in those of them it applies to)."""
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    """first (rank 0), middle, last, spare (the spare that took a rank)."""
    cases: list[str] = field(default_factory=list)
    """Explicit cases (FRAMEWORK/FAULT[+FAULT...]) instead of the product above."""
    fault_step: int = 3
    """The step the faults strike."""
    spares: int = 2
    """Spares per logical node (a lost node's ranks need the other node's spares)."""
    case_timeout_s: float = 300.0
    """A case still running after this is ``hung`` (its processes are killed)."""
    docs: str = ""
    """Also write the markdown table here (e.g. docs/faults.md); empty: no table."""
    hosts: bool = False
    """Real hosts: each logical node's launcher in a network namespace of its own (its own address,
    a switch between them; needs root and iproute2, skipped with the reason otherwise), and the
    host faults (``host_faults``) instead of the catalogue's."""
    host_faults: list[str] = field(default_factory=lambda: list(HOST_FAULTS))
    """cut (host 1's link down: a partition), slow (host 1's link rate-limited so mirror transfers
    miss the in-flight window, then a rank of it killed), node (every process of host 1 killed),
    blip (host 1's link down for half of ``node_timeout_s``, then back), launcher0 / launcher1
    (SIGKILL of that host's hotspare-run alone: nothing of the job may be alive 15 s later after
    node 0's; after node 1's, nothing of host 1 may be alive 15 s later and its ranks are replaced
    like a lost node's), keeper (host 1's keeper SIGKILLed: named, the job trains on)."""
    host_fault_after_s: float = 4.0
    """Seconds after training started that the host fault strikes."""
    node_timeout_s: float = 3.0
    """hotspare-run's --node-timeout-s in the hosts mode."""
    control: bool = False
    """The control-plane probes (``control_probes``) instead of the catalogue's faults: what a
    stranger on the store's port, another job or an operator's kill can do to a running job
    (docs/control-plane.md)."""
    control_probes: list[str] = field(default_factory=lambda: list(CONTROL_PROBES))
    """Which control-plane probes to run (CONTROL_PROBES)."""
    control_steps: int = 40
    """Training steps of the control mode's job (long enough for a probe to land mid-run)."""
    stragglers: bool = False
    """The straggler cases instead of the catalogue's faults: per framework (zero1, zero2, zero3,
    megatron with one pipeline stage: a stage's ranks are compared, and a class needs 3) the
    first, middle and last rank computes SLOWDOWN times slower from ``fault_step`` on, with
    ``hotspare.stragglers`` on (factor 2, window 5). Verdict ``handed_over``: the slow rank, and
    no other, moved to a spare at a step boundary (one generation, of kind handover), no iteration
    lost, bitwise."""
    straggler_steps: int = 80
    """Training steps of a straggler case (detection takes 10-20 steps here)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, values, allowed in (("frameworks", self.frameworks, FRAMEWORKS), ("kinds", self.kinds, catalogue.KINDS),
                                     ("phases", self.phases, catalogue.PHASES), ("targets", self.targets, TARGETS)):
            for v in values:
                if v not in allowed:
                    raise ConfigError(f"{key}: {v!r} is not one of {', '.join(allowed)}")
        for case in self.cases:
            parse_case(case)
        for p in self.control_probes:
            parse_probe(p)
        for f in self.host_faults:
            if f not in HOST_FAULTS:
                raise ConfigError(f"host_faults: {f!r} is not one of {', '.join(HOST_FAULTS)}")
        if self.hosts and self.parallel.logical_nodes != 2:
            raise ConfigError(f"hosts=true runs 2 hosts: parallel.logical_nodes must be 2, not "
                              f"{self.parallel.logical_nodes}")
        if self.fault_step < 1 or self.fault_step + 2 > self.train.steps:
            raise ConfigError(f"fault_step={self.fault_step} must be >= 1 and leave two steps after it "
                              f"(train.steps={self.train.steps})")


def parse_case(case: str) -> tuple[str, list[catalogue.Fault]]:
    framework, _, faults = case.partition("/")
    if framework not in FRAMEWORKS or not faults:
        raise ConfigError(f"cases: {case!r} must be FRAMEWORK/FAULT[+FAULT...] with FRAMEWORK one of "
                          f"{', '.join(FRAMEWORKS)}")
    try:
        return framework, [catalogue.Fault.parse(f) for f in faults.split("+")]
    except ValueError as exc:
        raise ConfigError(f"cases: {case!r}: {exc}") from None


def straggler_cases(cfg: FaultMatrixConfig, world: int) -> list[str]:
    return [f"{framework}/{catalogue.Fault('slow', 'forward', target_rank(t, world), cfg.fault_step, SLOWDOWN)}"
            for framework in cfg.frameworks if framework in STRAGGLER_FRAMEWORKS
            for t in cfg.targets if t != "spare"]


def handed_over(row: dict, ranks: dict) -> dict:
    """A straggler case's verdict from classify's ``row``: ``handed_over`` when it recovered
    bitwise in one generation, a planned handover, with no iteration lost (a second generation
    is a healthy rank taken for slow, or a failure)."""
    recoveries = [rec for r in ranks.values() for rec in r.get("recoveries", [])]
    kinds = {rec.get("kind") for rec in recoveries}
    generations = sorted({rec.get("generation") for rec in recoveries})
    if row["outcome"] != "recovered":
        return row
    if kinds != {"handover"} or row["lost_iterations"] or len(generations) != 1:
        return {**row, "outcome": "wrong", "note": f"recoveries of kind {sorted(map(str, kinds))} in generations "
                                                   f"{generations}, {row['lost_iterations']} iteration(s) lost: not one "
                                                   f"handover"}
    return {**row, "outcome": "handed_over", "note": "the slow rank moved to a spare at a step boundary"}


def target_rank(target: str, world: int) -> int:
    return {"first": 0, "middle": (world - 1) // 2, "last": world - 1, "spare": catalogue.SPARE}[target]


def product(cfg: FaultMatrixConfig, world: int, per_node: int) -> list[str]:
    """Every case of the matrix the config selects, in a fixed order."""
    cases = []
    for framework in cfg.frameworks:
        for kind in cfg.kinds:
            for phase in (p for p in cfg.phases if p in catalogue.PHASES_OF[kind]):
                for target in cfg.targets:
                    rank = target_rank(target, world)
                    faults = [catalogue.Fault(kind, phase, rank, cfg.fault_step)]
                    if rank == catalogue.SPARE or phase == "recovery":
                        # Something else must fail first: a rank of the other logical node (the spare
                        # that takes it is the target's spare, on the node that stays).
                        victim = 1 if rank == catalogue.SPARE else (rank + per_node) % world
                        faults.insert(0, catalogue.Fault("kill", "forward", victim, cfg.fault_step))
                    cases.append(f"{framework}/" + "+".join(str(f) for f in faults))
    return cases


def framework_job(data: dict, framework: str, megatron: dict | None = None) -> GPTJobConfig:
    """The job of ``data`` (a recipe's config) on ``framework``: a ZeRO stage, or megatron-core
    with the ``megatron`` overrides (configs/framework/megatron.yaml)."""
    job = {k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(GPTJobConfig)}}
    if framework == "megatron":
        if megatron is None:
            raise ValueError("framework_job(..., 'megatron') needs the megatron overrides")
        job = OmegaConf.to_container(OmegaConf.merge(job, megatron))
    else:
        job = {**job, "framework": "deepspeed", "zero": {**job["zero"], "stage": int(framework[-1])}}
    return from_mapping(GPTJobConfig, job)


def classify(code: int | None, tail: str, ranks: dict, ref: dict, world: int) -> dict:
    """Outcome, bitwise equality, lost iterations and recovery time of one case."""
    row = {"bitwise_identical": None, "lost_iterations": None, "recovery_s": None, "note": ""}
    recoveries = [rec for r in ranks.values() for rec in r.get("recoveries", [])]
    if recoveries:
        row["lost_iterations"] = max(int(rec.get("failed_at", rec["version"])) - int(rec["version"])
                                     for rec in recoveries)
        by_generation = {}
        for rec in recoveries:
            by_generation[rec["generation"]] = max(by_generation.get(rec["generation"], 0.0), rec.get("total_s", 0.0))
        row["recovery_s"] = sum(by_generation.values())
    if code is None:
        return {**row, "outcome": "hung", "note": "still running after case_timeout_s"}
    if code != 0:
        clean = code == ABORT_EXIT_CODE or "cannot recover" in tail
        note = next((line for line in reversed(tail.splitlines()) if "cannot recover" in line or "RecoveryError" in line),
                    tail.strip().splitlines()[-1] if tail.strip() else "")
        return {**row, "outcome": "stopped_cleanly" if clean else "crashed", "note": note[-300:]}
    if sorted(ranks) != list(range(world)):
        return {**row, "outcome": "crashed", "note": f"ranks that wrote results: {sorted(ranks)}"}
    identical = all((ranks[r]["fp32_digest"], ranks[r]["optimizer_digest"], ranks[r]["state_digest"]) ==
                    (ref[r]["fp32_digest"], ref[r]["optimizer_digest"], ref[r]["state_digest"])
                    and all(ref[r]["losses"].get(k) == v for k, v in ranks[r]["losses"].items()) for r in range(world))
    row["bitwise_identical"] = identical
    if not identical:
        return {**row, "outcome": "wrong", "note": "finished, but not bitwise identical to the uninterrupted run"}
    if not recoveries:
        return {**row, "outcome": "wrong", "note": "no recovery took place: the fault did not fire"}
    fell_back = any(rec.get("fallback") for rec in recoveries)
    return {**row, "outcome": "fell_back" if fell_back else "recovered"}


def describe(faults: list[catalogue.Fault], world: int) -> tuple[str, str, str]:
    """(fault, phase, rank label) of a case: its last fault (the first is a trigger, when two)."""
    f = faults[-1]
    label = {0: "first", world - 1: "last", catalogue.SPARE: "spare"}.get(f.rank, "middle")
    return f.kind, f.phase, f"{label} ({'spare' if f.rank == catalogue.SPARE else f.rank})"


def write_table(path: str, report: dict) -> None:
    rows = report["rows"]
    lines = ["# Fault matrix", "",
             "Generated by `recipes/fault_matrix.py` (do not edit by hand): "
             f"`{report['command']}`, {report['date']}, {report['seconds']:.0f} s.", "",
             "Summary: " + ", ".join(f"{k} {v}" for k, v in report["summary"]["outcomes"].items()) +
             f"; every case acceptable: **{report['summary']['all_acceptable']}**; most iterations lost by a "
             f"recovered case: {report['summary']['max_lost_iterations']}.", "",
             "| framework | fault | phase | rank | outcome | bitwise | lost | recovery s | case |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rec = f"{r['recovery_s']:.2f}" if r["recovery_s"] is not None else "-"
        bit = {True: "yes", False: "NO", None: "-"}[r["bitwise_identical"]]
        lost = "-" if r["lost_iterations"] is None else str(r["lost_iterations"])
        lines.append(f"| {r['framework']} | {r['fault']} | {r['phase']} | {r['rank']} | {r['outcome']} | {bit} | "
                     f"{lost} | {rec} | `{r['case']}` |")
    notes = [r for r in rows if r["note"]]
    if notes:
        lines += ["", "Notes:", ""] + [f"- `{r['case']}`: {r['note']}" for r in notes]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


@dataclass
class ChaosConfig(GPTJobConfig):
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
        if self.variant not in FRAMEWORKS:
            raise ConfigError(f"variant: {self.variant!r} is not one of {', '.join(FRAMEWORKS)}")
        if self.kills < 1 or self.min_gap_s <= 0 or self.window_s < (self.kills - 1) * self.min_gap_s:
            raise ConfigError(f"kills={self.kills}, min_gap_s={self.min_gap_s}, window_s={self.window_s}: need kills "
                              f">= 1 and a window of at least (kills - 1) * min_gap_s")


def schedule(cfg: ChaosConfig) -> list[float]:
    """Kill times (seconds after training started): seeded, sorted, ``min_gap_s`` apart, within
    the window."""
    rng = random.Random(cfg.seed)
    slack = cfg.window_s - (cfg.kills - 1) * cfg.min_gap_s
    offsets = sorted(rng.uniform(0, slack) for _ in range(cfg.kills))
    return [cfg.first_after_s + o + i * cfg.min_gap_s for i, o in enumerate(offsets)]
