"""What an optimizer holds beyond the tensors of its state: plain values, and state in native code.

A torch optimizer's per-parameter state mixes tensors (moments) with plain Python values:
DeepSpeed's ``FusedAdam`` and ``DeepSpeedCPUAdam`` keep ``state['step']`` as an ``int``,
where ``torch.optim.Adam`` keeps a tensor. Both are unique state; the plain values travel in
the snapshot's metadata (:func:`plain_state`, :func:`set_plain_state`).

Some optimizers also keep state in native code that Python cannot read or set. DeepSpeed's CPU
Adam kernel (``csrc/includes/cpu_adam.h``, ``Adam_Optimizer::IncrementStep``, used by
``DeepSpeedCPUAdam`` for ZeRO-Offload and by ``FusedAdam`` on the CPU accelerator) keeps
``beta1**t`` and ``beta2**t`` as float products, multiplied by beta once per step, and computes
them with ``pow`` when a call's step is not the last one plus 1. A rank that takes a step
``t`` without having taken ``1..t-1`` in that process (a spare, or any rank after loading an
older checkpoint) gets ``pow``'s rounding instead of the product's and diverges from a run that
never failed. :class:`NativeSteps` puts the same products back by calling the kernel for steps
``1..t`` on empty tensors (pinned by tests/test_optim_state.py); a rank whose kernel saw the
landing step or the one after it skips that (at most one iteration is ever rolled back).

:func:`coverage` is the guard against the whole class of bug: after the first optimizer steps
it lists what an optimizer or engine holds that changes with training and that the capture
would miss, so hotspare can say so at start-up instead of training on after a wrong restore.
"""
from __future__ import annotations

import math

import torch

PLAIN = (bool, int, float, str, type(None))

# Optimizer classes whose every training-dependent value is in ``state`` and ``param_groups``
# (a plain value or a tensor), or whose native state :class:`NativeSteps` restores. By name,
# so that this module imports no host framework.
KNOWN_OPTIMIZERS = frozenset({
    "torch.optim.adam.Adam", "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD", "torch.optim.adagrad.Adagrad",
    "torch.optim.rmsprop.RMSprop", "torch.optim.adamax.Adamax", "torch.optim.nadam.NAdam",
    "torch.optim.radam.RAdam", "torch.optim.adadelta.Adadelta",
    "deepspeed.ops.adam.fused_adam.FusedAdam", "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam",
    "deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad", "deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion",
    "deepspeed.ops.lion.fused_lion.FusedLion", "deepspeed.ops.lamb.fused_lamb.FusedLamb",
})


def qualname(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def jsonable(value):
    """Python, NumPy and one-element torch values as JSON types; anything else is a TypeError."""
    import numpy as np

    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}  # JSON has no NaN or infinity; a loss scaler may hold inf
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if torch.is_tensor(value) and value.numel() == 1:
        return jsonable(value.item())
    raise TypeError(f"cannot mirror a value of type {type(value).__name__} ({value!r:.80}); unique state metadata "
                    f"must be numbers, strings, lists or dicts")


def from_json(value):
    """The inverse of :func:`jsonable` for the values it encodes specially (non-finite floats)."""
    if isinstance(value, dict):
        if set(value) == {"float"} and isinstance(value["float"], str):
            return float(value["float"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def plain_state(optimizer, params) -> list[dict]:
    """Per parameter of ``params`` (in order): its state entries that are not tensors, as JSON."""
    return [{str(k): jsonable(v) for k, v in optimizer.state.get(p, {}).items() if not torch.is_tensor(v)}
            for p in params]


def set_plain_state(optimizer, params, saved: list[dict]) -> None:
    """Put the values of :func:`plain_state` back (the state of each parameter must exist)."""
    if len(saved) != len(params):
        raise ValueError(f"the snapshot has plain optimizer state for {len(saved)} parameters, this optimizer "
                         f"{len(params)}; is every rank running the same model and config?")
    for p, entries in zip(params, saved):
        state = optimizer.state[p]
        for k, v in entries.items():
            state[k] = from_json(v)


def group_steps(optimizer, params) -> list[int | None]:
    """The ``step`` of each parameter's state as an int (None where it has none)."""
    out = []
    for p in params:
        step = optimizer.state.get(p, {}).get("step")
        out.append(None if step is None else int(step.item() if torch.is_tensor(step) else step))
    return out


class NativeSteps:
    """Restores the step history DeepSpeed's CPU Adam kernel keeps in native code.

    ``prepare()`` before the optimizer's state is overwritten (it reads the steps the kernel
    has seen), ``resync()`` after: the kernel is brought to what steps ``1..t`` in sequence
    leave, unless it saw ``t`` or ``t + 1`` already. :meth:`of` returns None for optimizers
    without such state.
    """

    def __init__(self, optimizer, params, groups, call):
        self.optimizer, self.params, self.groups, self._call = optimizer, list(params), list(groups), call
        self._seen: list[int | None] | None = None
        self.replayed = 0
        """Kernel calls the last :meth:`resync` made (0: it needed none)."""

    @classmethod
    def of(cls, optimizer, params, groups, accelerator: str) -> "NativeSteps | None":
        """``groups``: the param group each of ``params`` steps with (ZeRO 3 puts a partition into
        its group only for its step); ``accelerator``: DeepSpeed's accelerator name."""
        name = qualname(optimizer)
        if name == "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam":
            op, opt_id = optimizer.ds_opt_adam, optimizer.opt_id

            def call(step, group, empty):
                op.adam_update(opt_id, step, group["lr"], group["betas"][0], group["betas"][1], group["eps"],
                               group["weight_decay"], group["bias_correction"], *empty)
            return cls(optimizer, params, groups, call)
        if name == "deepspeed.ops.adam.fused_adam.FusedAdam" and accelerator == "cpu":
            # The CPU build's multi_tensor_adam keeps one kernel object per mode for the whole process
            # (csrc/cpu/adam/fused_adam.cpp); the CUDA kernel computes beta**t from the step each call.
            op, noop, mode = optimizer.multi_tensor_adam, optimizer._dummy_overflow_buf, optimizer.adam_w_mode

            def call(step, group, empty):
                g, p, m, v = ([t] for t in empty)
                op(2048 * 32, noop, [g, p, m, v], group["lr"], group["betas"][0], group["betas"][1], group["eps"],
                   step, mode, 1 if group["bias_correction"] else 0, group["weight_decay"])
            return cls(optimizer, params, groups, call)
        return None

    def prepare(self) -> None:
        self._seen = group_steps(self.optimizer, self.params)

    def resync(self) -> None:
        target = group_steps(self.optimizer, self.params)
        seen, self._seen = self._seen, None
        self.replayed = 0
        if seen is not None and all(t is None or (s is not None and s in (t, t + 1)) for s, t in zip(seen, target)):
            return
        self.replay(target)

    def replay(self, target: list[int | None]) -> None:
        """Call the kernel for steps 1..t of each parameter, in the order a training step calls it."""
        groups = self.groups
        empty = [torch.empty(0, dtype=torch.float32) for _ in range(4)]
        calls = [(t, groups[i]) for i, t in enumerate(target) if t]
        for step in range(1, max((t for t, _ in calls), default=0) + 1):
            last = None
            for t, group in calls:
                betas = tuple(group["betas"])
                if t >= step and betas != last:  # a repeated (step, betas) returns at once in the kernel
                    self._call(step, group, empty)
                    self.replayed += 1
                    last = betas


def coverage(optimizer, params, *, captured_tensor_ids: set[int], known=KNOWN_OPTIMIZERS) -> list[str]:
    """What ``optimizer`` holds for ``params`` that a capture of its tensors (``captured_tensor_ids``),
    its plain state entries and its param groups would miss, one line each; [] when nothing."""
    problems = []
    name = qualname(optimizer)
    if name not in known:
        problems.append(f"optimizer {name} is not one hotspare knows: its state entries and param groups are "
                        f"recovered, state it keeps elsewhere (attributes, native code) is not")
    owned = {id(p) for p in params}
    for p, state in optimizer.state.items():
        if id(p) not in owned:
            problems.append(f"optimizer {name} has state for a tensor of shape {tuple(p.shape)} that is not one of "
                            f"the parameters hotspare captures")
            continue
        for k, v in state.items():
            if torch.is_tensor(v):
                if id(v) not in captured_tensor_ids:
                    problems.append(f"optimizer {name}: state entry {k!r} (a tensor) is not captured")
            else:
                try:
                    jsonable(v)
                except TypeError:
                    problems.append(f"optimizer {name}: state entry {k!r} is a {type(v).__name__}, which hotspare "
                                    f"cannot capture")
    for i, group in enumerate(optimizer.param_groups):
        for k, v in group.items():
            if k == "params":
                continue
            try:
                jsonable(v)
            except TypeError:
                problems.append(f"optimizer {name}: param group {i} entry {k!r} is a {type(v).__name__}, which "
                                f"hotspare cannot capture")
    return problems


def plain_attributes(obj) -> dict[str, object]:
    """``obj``'s instance attributes that hold plain values (numbers, strings, booleans)."""
    return {k: v for k, v in vars(obj).items() if isinstance(v, PLAIN) and not isinstance(v, str)}


def changed_attributes(before: dict, after: dict, *, captured: set[str], ignored: set[str]) -> list[str]:
    """Names of plain attributes whose value changed between two steps and that are neither captured
    nor known to be irrelevant to the next step's result."""
    return sorted(k for k in after if k in before and before[k] != after[k] and k not in captured | ignored
                  and not (isinstance(after[k], float) and math.isnan(after[k]) and math.isnan(before[k])))
