"""What optimizers hold beyond their tensors (hotspare.integrations.optim_state), one process, CPU.

Pins the DeepSpeed internal the restore of the CPU Adam kernel relies on: the kernel keeps
beta**t as a running product, so a process that takes step t without steps 1..t-1 computes it
with pow and diverges (the silent wrong restore of DeepSpeed's default optimizer); replaying
steps 1..t on empty tensors puts the product back. Needs DeepSpeed's fused_adam and cpu_adam
ops (built once per venv, about a minute each on 2 cores).
"""
from __future__ import annotations

import math

import pytest
import torch

from hotspare.integrations import optim_state


def _train(opt, param, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        param.grad = torch.randn(param.shape, generator=g)
        opt.step()


def _reset_kernel(make):
    """Any call at step 1 resets the kernel's product (pow(beta, 1) is exact): a fresh process."""
    p = torch.zeros(4, requires_grad=True)
    o = make([p])
    _train(o, p, 1, seed=99)
    return o


def _cases():
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    return {"fused_adam": lambda params: FusedAdam(params, lr=1e-2, betas=(0.9, 0.999)),
            "cpu_adam": lambda params: DeepSpeedCPUAdam(params, lr=1e-2, betas=(0.9, 0.999))}


# cpu_adam (ZeRO-Offload's) is a second minute-long JIT build in a fresh venv: make slow.
@pytest.mark.parametrize("kind", ["fused_adam", pytest.param("cpu_adam", marks=pytest.mark.slow)])
def test_a_kernel_that_skipped_steps_diverges_and_the_replay_mends_it(kind, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    make = _cases()[kind]
    steps = 37  # the kernel's pow(beta, 38) and its product of 38 factors differ in float32

    def run(replay: bool):
        torch.manual_seed(0)
        param = torch.randn(64, requires_grad=True)
        opt = make([param])
        _train(opt, param, steps)  # steps 1..37: the kernel's product
        snapshot = (param.detach().clone(), {k: (v.clone() if torch.is_tensor(v) else v)
                                            for k, v in opt.state[param].items()})
        # The uninterrupted continuation: step 38 on the same kernel.
        _train(opt, param, 1, seed=1)
        reference = param.detach().clone()
        # A spare: a new optimizer (a kernel that saw only its own set-up step) given the state.
        _reset_kernel(make)
        param2 = snapshot[0].clone().requires_grad_(True)
        opt2 = make([param2])
        opt2.state[param2].update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in snapshot[1].items()})
        if replay:
            native = optim_state.NativeSteps.of(opt2, [param2], [opt2.param_groups[0]], "cpu")
            assert native is not None
            native.replay(optim_state.group_steps(opt2, [param2]))
            assert native.replayed == steps
        _train(opt2, param2, 1, seed=1)
        return reference, param2.detach()

    reference, without = run(replay=False)
    assert not torch.equal(reference, without), "the kernel no longer keeps beta**t as a product: re-check NativeSteps"
    reference, mended = run(replay=True)
    assert torch.equal(reference, mended)


def test_resync_skips_a_kernel_that_saw_the_landing_step_or_the_next():
    calls = []
    p = torch.zeros(2)
    opt = torch.optim.SGD([p], lr=0.1)
    native = optim_state.NativeSteps(opt, [p], [opt.param_groups[0] | {"betas": (0.9, 0.99)}],
                                     lambda step, group, empty: calls.append(step))
    for seen, target, replayed in ((5, 5, 0), (6, 5, 0), (7, 5, 5), (1, 5, 5), (None, 3, 3)):
        if seen is None:
            opt.state.pop(p, None)
        else:
            opt.state[p]["step"] = seen
        native.prepare()
        opt.state[p]["step"] = target
        calls.clear()
        native.resync()
        assert native.replayed == replayed == len(calls), (seen, target)
        assert calls == list(range(1, replayed + 1))


def test_plain_state_round_trip_and_non_finite_values():
    p = torch.zeros(3)
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p].update({"step": 7, "scale": float("inf"), "moment": torch.ones(3)})
    saved = optim_state.plain_state(opt, [p])
    assert saved == [{"step": 7, "scale": {"float": "inf"}}]
    opt.state[p].update({"step": 1, "scale": 0.0})
    optim_state.set_plain_state(opt, [p], saved)
    assert opt.state[p]["step"] == 7 and type(opt.state[p]["step"]) is int and opt.state[p]["scale"] == math.inf
    with pytest.raises(ValueError, match="same model and config"):
        optim_state.set_plain_state(opt, [p, p], saved)


def test_coverage_names_what_a_capture_would_miss():
    p = torch.zeros(3)

    class Odd(torch.optim.SGD):
        pass

    opt = Odd([p], lr=0.1)
    opt.state[p].update({"step": 3, "m": torch.ones(3), "hook": object()})
    problems = optim_state.coverage(opt, [p], captured_tensor_ids=set())
    text = "\n".join(problems)
    assert "is not one hotspare knows" in text and "Odd" in text
    assert "'m' (a tensor) is not captured" in text
    assert "'hook' is a object" in text
    assert "'step'" not in text
    known = torch.optim.SGD([p], lr=0.1)
    known.state[p]["momentum_buffer"] = torch.ones(3)
    assert optim_state.coverage(known, [p], captured_tensor_ids={id(known.state[p]["momentum_buffer"])}) == []
    stray = torch.ones(5)
    known.state[stray] = {"x": 1}
    assert "not one of the parameters" in "\n".join(optim_state.coverage(known, [p], captured_tensor_ids=set()))
