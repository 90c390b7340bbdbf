"""The fault-tolerance systems a user could pick instead of hotspare, measured on the same job
(``recipes/bench_peers.py``, docs/peers.md): what every system's run is reduced to, and the
measures computed from it the same way for all.

Each training process (a *slot*: 4 of them, whatever process holds the slot now) leaves step
records: when a step ended (CLOCK_MONOTONIC, shared by the processes of one machine), its index,
whether its update was applied (``committed``) and by how many processes (``participants``), and
whether this process's work went into it (``participating``). The fault is one time and one step:
the victim is SIGKILLed before the forward of ``fault_step``. From that alone:

- survivor downtime: until every survivor completed a step again (committed);
- time to full strength: until a step is committed with every slot contributing;
- lost steps, per slot: step results thrown away (not committed, or the process's work not in
  it), steps computed again (an index at or below the progress the job had at the fault), and
  for a survivor the step it was in when the fault struck, when no record says it was thrown
  away (it is computed again, partly);
- GPU-seconds lost: over the window from the fault until the job is back at full strength past
  its progress at the fault, each slot's time minus its useful steps (committed, its own work in
  it, new progress) times the steady step time.

The peers' training loops share the smoke GPT and its data with hotspare's (:func:`build`).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass


@dataclass
class Step:
    slot: int
    step: int
    t: float
    committed: bool = True
    participants: int = 0
    participating: bool = True
    loss: float | None = None
    attempt: int = 0
    """0: the run as started; more: after a restart (a new process, a new restart iteration)."""


@dataclass
class Run:
    """One system's run with a fault: every slot's step records, the fault, the world size."""

    steps: list[Step]
    t_fault: float
    fault_step: int
    victim: int
    world: int


def steady_step_time(records: list[Step], until: float = float("inf"), skip: int = 5) -> float:
    """The median time between slot 0's consecutive committed steps before ``until``."""
    mine = sorted((s.t for s in records if s.slot == 0 and s.committed and s.t < until))[skip:]
    gaps = [b - a for a, b in zip(mine, mine[1:])]
    if not gaps:
        raise ValueError("too few steps to time the steady state")
    return statistics.median(gaps)


def measure(run: Run, step_time: float) -> dict:
    """The issue's columns for ``run`` (None where the run never got there)."""
    # A step before the fault step that a survivor finished just after the victim's last record
    # belongs to the run before the fault; the same step done again after a restart does not.
    after = sorted((s for s in run.steps if s.t > run.t_fault and (s.step >= run.fault_step or s.attempt > 0)),
                   key=lambda s: s.t)
    survivors = [slot for slot in range(run.world) if slot != run.victim]
    firsts = [next((s.t for s in after if s.slot == slot and s.committed), None) for slot in survivors]
    downtime = None if None in firsts else max(firsts) - run.t_fault
    full = next((s for s in after if s.committed and s.participants >= run.world), None)
    progress = run.fault_step - 1  # the last step every slot had completed at the fault
    back = next((s for s in after if s.committed and s.participants >= run.world and s.step > progress), None)
    lost, gpu = {}, 0.0
    for slot in range(run.world):
        mine = [s for s in after if s.slot == slot and (back is None or s.t <= back.t)]
        thrown = sum(not (s.committed and s.participating) for s in mine)
        again = sum(s.committed and s.participating and s.step <= progress for s in mine)
        in_flight = 1 if slot != run.victim and thrown == 0 else 0
        lost[slot] = thrown + again + in_flight
        if back is not None:
            useful = sum(s.committed and s.participating and s.step > progress for s in mine)
            gpu += max(0.0, back.t - run.t_fault - useful * step_time)
    return {"survivor_downtime_s": downtime,
            "time_to_full_strength_s": None if full is None else full.t - run.t_fault,
            "back_at_progress_s": None if back is None else back.t - run.t_fault,
            "lost_steps": max(lost.values()), "lost_steps_per_process": {str(k): v for k, v in lost.items()},
            "gpu_seconds_lost": gpu if back is not None else None}


def max_loss_diff(ref: dict[int, float], got: dict[int, float], since: int) -> float | None:
    """The largest |loss difference| over the steps from ``since`` both runs have."""
    common = [k for k in got if k >= since and k in ref]
    return max((abs(ref[k] - got[k]) for k in common), default=None)


COLUMNS = ("survivor_downtime_s", "time_to_full_strength_s", "lost_steps", "gpu_seconds_lost", "standing_spare_gpus",
           "step_time_s", "step_time_no_ft_s", "bitwise_identical", "max_loss_diff")


def table(systems: dict[str, dict]) -> str:
    """The benchmark's systems as a markdown table (docs/peers.md)."""
    def cell(v) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    heads = [c[:-2].replace("_", " ") + " (s)" if c.endswith("_s") else c.replace("_", " ") for c in COLUMNS]
    lines = ["| system | " + " | ".join(heads) + " |",
             "|---" * (len(COLUMNS) + 1) + "|"]
    for name, r in systems.items():
        cells = [f"error: {r['error']}"] + [""] * (len(COLUMNS) - 1) if "error" in r else [cell(r.get(c)) for c in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the peers' training loops ---------------------------------------------------------------
class Recorder:
    """A process's records, appended to ``<out_dir>/rec<name>.jsonl`` as they happen; ``slot`` is
    the rank it trains as (it may change: an NVRx reserve takes the dead rank's)."""

    def __init__(self, out_dir: str, slot: int, incarnation: int, name: str = ""):
        self.slot, self.incarnation = slot, incarnation
        self._f = open(os.path.join(out_dir, f"rec{name or slot}.{incarnation}.jsonl"), "a", buffering=1,
                       encoding="utf-8")

    def __call__(self, kind: str, **fields) -> None:
        self._f.write(json.dumps({"kind": kind, "slot": self.slot, "inc": self.incarnation, "t": time.monotonic(),
                                  **fields}) + "\n")

    def step(self, step: int, committed: bool, participants: int, participating: bool, loss: float) -> None:
        self("step", step=step, committed=bool(committed), participants=int(participants),
             participating=bool(participating), loss=float(loss))


def read_records(out_dir: str) -> tuple[list[Step], list[dict]]:
    """Every process's step records, and all records."""
    import glob

    records = []
    for path in sorted(glob.glob(os.path.join(out_dir, "rec*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            records += [json.loads(line) for line in f if line.strip()]
    steps = [Step(r["slot"], r["step"], r["t"], r["committed"], r["participants"], r["participating"], r["loss"],
                  r["inc"]) for r in records if r["kind"] == "step"]
    return steps, records


def build(run: dict):
    """The smoke model (the project's GPT, or the transformers family ``model.family`` of the same
    shape), its AdamW and its data for one data-parallel rank of a peer's loop, from the
    benchmark's run description (``model``, ``train``): the same shape, seed, batch and learning
    rate as hotspare's job. Returns (model, optimizer, sampler, loss(module, tokens, targets))."""
    import torch

    from ..env import make_deterministic
    from . import hf
    from .data import ByteSampler, load_corpus
    from .gpt import GPTConfig

    train = run["train"]
    make_deterministic(train["seed"])
    model_cfg = GPTConfig(**run["model"])
    model, _ = hf.model_and_loss(model_cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train["lr"], betas=(0.9, 0.95),
                                  weight_decay=train["weight_decay"])
    sampler = ByteSampler(load_corpus(run.get("corpus", "")), model_cfg.seq_len, train["micro_batch"],
                          seed=train["seed"])

    def loss(module, tokens, targets):
        return module(tokens, targets) if model_cfg.family == "gpt" else hf.loss(module, tokens)

    return model, optimizer, sampler, loss


def kill_me_here(recorder: Recorder, run: dict, slot: int, step: int, incarnation: int) -> None:
    """The fault: the victim's first incarnation SIGKILLs itself before the forward of the
    fault step (the moment is recorded first: ``fault``)."""
    import signal

    if incarnation == 0 and slot == run["kill_slot"] and step == run["kill_step"]:
        recorder("fault", step=step)
        os.kill(os.getpid(), signal.SIGKILL)
