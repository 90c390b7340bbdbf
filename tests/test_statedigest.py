"""The tests' state digest (hotspare.testing.statedigest) sees every kind of entry the bitwise
checks rely on: a check that cannot see a difference cannot fail."""
from __future__ import annotations

import random

import numpy as np
import torch

from hotspare.testing import statedigest


def test_an_int_step_a_float_step_and_a_tensor_step_digest_differently():
    # DeepSpeed's FusedAdam keeps state['step'] as an int, torch's Adam as a tensor: a restore that
    # turns one into the other is a difference, and so is a step one higher.
    digests = {statedigest.of({0: {"step": s}}) for s in (3, 3.0, torch.tensor(3.0), 4)}
    assert len(digests) == 4


def test_tensors_digest_by_dtype_shape_and_bytes():
    base = torch.arange(6, dtype=torch.float32)
    variants = [base, base.to(torch.float64), base.reshape(2, 3), base + 1, base.to(torch.bfloat16)]
    assert len({statedigest.of(t) for t in variants}) == len(variants)
    assert statedigest.of(base.clone()) == statedigest.of(base)


def test_each_generator_changes_the_rng_digest():
    for name, draw in (("python", random.random), ("numpy", np.random.rand), ("torch", lambda: torch.rand(1))):
        before = statedigest.of(statedigest.rng_states())
        draw()
        assert statedigest.of(statedigest.rng_states()) != before, name


def test_module_state_covers_parameters_and_buffers():
    m = torch.nn.BatchNorm1d(3)
    before = statedigest.of(statedigest.module_state(m))
    m.running_mean.add_(1)  # a buffer, not a parameter
    assert statedigest.of(statedigest.module_state(m)) != before
    with torch.no_grad():
        m.weight.add_(1)
    assert set(statedigest.module_state(m)) >= {"param.weight", "param.bias", "buffer.running_mean",
                                                "buffer.num_batches_tracked"}


def test_differences_names_the_parts_that_differ_or_are_missing():
    a = {"module": "1", "rng": "2", "counters": "3"}
    assert statedigest.differences(a, dict(a)) == []
    assert statedigest.differences(a, {**a, "rng": "x"}) == ["rng"]
    assert statedigest.differences(a, {"module": "1", "rng": "2"}) == ["counters"]
