"""Strict validation of hotspare's typed config: the DeepSpeed "hotspare" section and the
recipe schema. Pure Python; needs no process group."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import pytest
import torch

import hotspare
from hotspare.config import ConfigError, HotspareConfig, from_mapping, split_deepspeed_config, to_mapping


@dataclass
class Inner:
    """Nested schema used to exercise the mechanism."""

    count: int = 1
    """A count."""
    ratio: float = 0.5
    """A number."""


@dataclass
class Outer:
    """Schema with a required field, a nested one and a list."""

    name: str
    """Required."""
    inner: Inner = field(default_factory=Inner)
    """Nested."""
    tags: list[str] = field(default_factory=list)
    """A list."""
    flag: bool = False
    """A switch."""


def test_valid_mapping_round_trips():
    obj = from_mapping(Outer, {"name": "a", "inner": {"count": 3, "ratio": 2}, "tags": ["x"], "flag": True})
    assert obj == Outer(name="a", inner=Inner(count=3, ratio=2.0), tags=["x"], flag=True)
    assert from_mapping(Outer, to_mapping(obj)) == obj


@pytest.mark.parametrize("data, message", [
    ({"name": "a", "zzz": 1}, "zzz: unknown key; allowed keys: flag, inner, name, tags"),
    ({"name": "a", "inner": {"cuont": 1}}, "inner.cuont: unknown key (did you mean 'count'?)"),
    ({"name": "a", "inner": {"count": "3"}}, "inner.count: expected an integer, got str '3'"),
    ({"name": "a", "inner": {"count": True}}, "inner.count: expected an integer, got bool True"),
    ({"name": "a", "flag": 1}, "flag: expected true or false, got int 1"),
    ({"name": "a", "inner": {"ratio": "x"}}, "inner.ratio: expected a number"),
    ({"name": "a", "inner": {"ratio": float("nan")}}, "inner.ratio: expected a finite number, got nan"),
    ({"name": "a", "inner": {"ratio": float("-inf")}}, "inner.ratio: expected a finite number, got -inf"),
    ({"name": "a", "tags": "x"}, "tags: expected a list of str"),
    ({"name": "a", "tags": [1]}, "tags[0]: expected a string"),
    ({"name": "a", "inner": 3}, "inner: expected a mapping for Inner"),
    ({}, "missing required key(s) name"),
])
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ConfigError) as info:
        from_mapping(Outer, data)
    assert message in str(info.value)


def test_deepspeed_section_split_and_validated(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "hotspare": {"enabled": False}}
    rest, hs = split_deepspeed_config(ds)
    assert rest == {"train_micro_batch_size_per_gpu": 2}
    assert hs == HotspareConfig(enabled=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    assert split_deepspeed_config(str(path)) == (rest, hs)
    assert split_deepspeed_config({"a": 1}) == ({"a": 1}, None)
    path.write_text('{"hotspare": {"retain": {"budget_mb": NaN}}}')
    with pytest.raises(ConfigError, match="hotspare.retain.budget_mb: expected a finite number, got nan"):
        split_deepspeed_config(str(path))
    path.write_text('{"train_micro_batch_size_per_gpu": 2,\n "hotspare": {')
    with pytest.raises(ConfigError, match=f"DeepSpeed config {path}: not JSON at line 2, column 15"):
        split_deepspeed_config(str(path))
    with pytest.raises(ConfigError, match="cannot read it"):
        split_deepspeed_config(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("section, message", [
    ({"enabeld": True}, "hotspare.enabeld: unknown key (did you mean 'enabled'?); allowed keys:"),
    ({"enabled": "yes"}, "hotspare.enabled: expected true or false, got str 'yes'"),
    ([], "hotspare: expected a mapping"),
])
def test_initialize_rejects_bad_section_before_anything_starts(section, message):
    """Startup stops at the config, before any process group or engine exists."""
    with pytest.raises(ConfigError) as info:
        hotspare.initialize(model=torch.nn.Linear(2, 2), config={"hotspare": section})
    assert message in str(info.value)
    assert not torch.distributed.is_initialized()


def test_recipe_schema_checks(tmp_path):
    from hotspare.testing import job as gpt_job

    with pytest.raises(ConfigError, match="zero.stage: 4 is not allowed; expected one of 1, 2, 3"):
        from_mapping(gpt_job.GPTJobConfig, {"zero": {"stage": 4}}, prefix="")
    with pytest.raises(ConfigError, match="zero.dtype: 'fp16' is not allowed"):
        from_mapping(gpt_job.GPTJobConfig, {"zero": {"dtype": "fp16"}})
    with pytest.raises(ConfigError, match="parallel.logical_nodes=3 must divide parallel.num_ranks=4"):
        from_mapping(gpt_job.GPTJobConfig, {"parallel": {"logical_nodes": 3}})
    with pytest.raises(ConfigError, match="model.hidden_size=65 is not divisible"):
        from_mapping(gpt_job.GPTJobConfig, {"model": {"hidden_size": 65}})
    for overrides, message in [  # fields outside the hotspare section, once handed to torch as is
            ({"parallel": {"store_timeout_s": -1}}, "parallel.store_timeout_s=-1.0 must be > 0"),
            ({"parallel": {"collective_timeout_s": 0.001}}, "parallel.collective_timeout_s=0.001 must be at least 1"),
            ({"parallel": {"collective_timeout_s": float("inf")}},
             "parallel.collective_timeout_s: expected a finite number, got inf"),
            ({"train": {"lr": 0}}, "train.lr=0.0 must be > 0"),
            ({"train": {"grad_clip": -1}}, "train.grad_clip=-1.0 must be >= 0")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            from_mapping(gpt_job.GPTJobConfig, overrides)
    megatron = {"framework": "megatron", "parallel": {"pipeline_stages": 2}}
    for overrides, message in [
            ({"parallel": {"tensor_parallel": 2}}, "parallel.tensor_parallel=2: model parallelism is the megatron"),
            ({**megatron, "parallel": {"pipeline_stages": 2, "tensor_parallel": 3}},
             "parallel.pipeline_stages=2 x parallel.tensor_parallel=3 must divide parallel.num_ranks=4"),
            ({**megatron, "parallel": {"pipeline_stages": 1, "virtual_stages": 2}},
             "parallel.virtual_stages=2 needs parallel.pipeline_stages >= 2"),
            ({**megatron, "parallel": {"pipeline_stages": 2, "virtual_stages": 2}, "model": {"num_layers": 2}},
             "model.num_layers=2 must be divisible by parallel.pipeline_stages=2 x parallel.virtual_stages=2"),
            ({**megatron, "parallel": {"pipeline_stages": 2, "virtual_stages": 2}, "model": {"num_layers": 4},
              "train": {"grad_accum": 3}}, "train.grad_accum=3 (microbatches per iteration) must be a multiple of"),
            ({"parallel": {"virtual_stages": 2}}, "parallel.virtual_stages=2: model parallelism is the megatron"),
            ({**megatron, "parallel": {"pipeline_stages": 1, "tensor_parallel": 4}, "model": {"vocab_size": 250}},
             "model.vocab_size=250 must be divisible by parallel.tensor_parallel=4"),
            ({**megatron, "parallel": {"pipeline_stages": 1, "tensor_parallel": 4}, "model": {"num_heads": 2}},
             "model.num_heads=2 must be divisible by parallel.tensor_parallel=4")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            from_mapping(gpt_job.GPTJobConfig, overrides)
    job = from_mapping(gpt_job.GPTJobConfig, {"framework": "megatron", "model": {"num_layers": 4},
                                              "train": {"grad_accum": 4}, "parallel": {
        "pipeline_stages": 2, "tensor_parallel": 2, "virtual_stages": 2}})
    assert gpt_job.megatron_layout({"pipeline_stages": 2, "tensor_parallel": 2, "virtual_stages": 2,
                                     "num_ranks": job.parallel.num_ranks}) == \
        "2 pipeline stages (2 virtual each, interleaved) x 2 tensor-parallel x 1 data-parallel, distributed optimizer"
    job = from_mapping(gpt_job.GPTJobConfig, {"zero": {"stage": 3, "dtype": "bf16"}})
    ds = gpt_job.deepspeed_config(job)
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"] == {"enabled": True}
    # The section the recipe writes is itself valid.
    assert split_deepspeed_config(ds)[1] == job.hotspare


@pytest.mark.parametrize("section, message", [
    ({"mirror": {"enabled": 1}}, "hotspare.mirror.enabled: expected true or false"),
    ({"mirror": {"replicas": -1}}, "hotspare.mirror.replicas=-1 must be >= 0"),
    ({"mirror": {"in_flight": "drop"}}, "hotspare.mirror.in_flight: 'drop' is not allowed; expected one of 'wait', 'skip'"),
    ({"mirror": {"chunk_mb": 0}}, "hotspare.mirror.chunk_mb=0.0 must be > 0"),
    ({"mirror": {"timeout_s": -1}}, "hotspare.mirror.timeout_s=-1.0 must be > 0"),
    ({"mirror": {"replica": 2}}, "hotspare.mirror.replica: unknown key (did you mean 'replicas'?)"),
    ({"recovery": {"enabled": "no"}}, "hotspare.recovery.enabled: expected true or false"),
    ({"recovery": {"heartbeat_interval_s": 0}}, "hotspare.recovery.heartbeat_interval_s=0.0 must be > 0"),
    ({"recovery": {"heartbeat_timeout_s": 0.6}}, "heartbeat_timeout_s=0.6 must be at least twice"),
    ({"recovery": {"collective_timeout_s": 5}}, "hotspare.recovery.collective_timeout_s=5.0 must be longer than"),
    ({"recovery": {"rendezvous_timeout_s": -2}}, "hotspare.recovery.rendezvous_timeout_s=-2.0 must be > 0"),
    ({"recovery": {"max_recoveries": -1}}, "hotspare.recovery.max_recoveries=-1 must be >= 0"),
    ({"recovery": {"max_recoveries": 1.5}}, "hotspare.recovery.max_recoveries: expected an integer"),
    ({"checkpoint": {"every": 50}}, "hotspare.checkpoint.every=50 needs checkpoint.dir"),
    ({"checkpoint": {"dir": "/ckpt"}}, "hotspare.checkpoint.dir='/ckpt' is set but checkpoint.every is 0"),
    ({"checkpoint": {"dir": "/ckpt", "every": -1}}, "hotspare.checkpoint.every=-1 must be >= 0"),
    ({"retain": {"budget_mb": -1}}, "hotspare.retain.budget_mb=-1.0 must be >= 0"),
    ({"retain": {"keeper": 1}}, "hotspare.retain.keeper: expected true or false"),
    ({"checkpoint": {"dir": "/ckpt", "every": 5, "keep": 0}}, "hotspare.checkpoint.keep=0 must be at least 1"),
    ({"checkpoint": {"path": "/ckpt"}}, "hotspare.checkpoint.path: unknown key"),
])
def test_every_field_is_checked(section, message):
    with pytest.raises(ConfigError) as info:
        split_deepspeed_config({"hotspare": section})
    assert message in str(info.value)
