"""Worker for tests/test_deepspeed_internals.py: builds a ZeRO engine through hotspare on the
launcher's ranks and checks the DeepSpeed internals hotspare relies on. Exits non-zero with
an AssertionError that names the internal when one moved."""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import hotspare
from hotspare.integrations.deepspeed import fp32_partitions, optimizer_state_tensors
from tiny import tiny_model_and_config


def main(stage: int, dtype: str, out: str) -> None:
    # bf16 runs with no "hotspare" section: a plain DeepSpeed run through hotspare.initialize
    # (the internals are the same; rank 0 says that hotspare is off).
    model, ds = tiny_model_and_config(stage, **({} if dtype == "bf16" else {"hotspare": {"enabled": True}}))
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    session = hotspare.initialize(model=model, config=ds, model_parameters=model.parameters())
    engine, opt = session.engine, session.engine.optimizer
    inner = opt.optimizer
    parts = fp32_partitions(engine)
    name = type(opt).__name__
    if stage in (1, 2):
        assert name == "DeepSpeedZeroOptimizer", f"ZeRO {stage} optimizer is {name}"
        assert len(parts) == len(inner.param_groups)
        for i, part in enumerate(parts):
            assert inner.param_groups[i]["params"] == [part], \
                "single_partition_of_fp32_groups[i] is no longer the inner optimizer's only param of group i"
        for attr in ("bit16_groups_flat", "parallel_partitioned_bit16_groups", "groups_padding",
                     "partition_count", "dp_process_group", "real_dp_process_group"):
            assert hasattr(opt, attr), f"DeepSpeedZeroOptimizer.{attr} is gone"
        bit16_dtype = opt.bit16_groups_flat[0].dtype
    else:
        assert name == "DeepSpeedZeroOptimizer_Stage3", f"ZeRO 3 optimizer is {name}"
        # ZeRO 3 puts each sub-group's fp32 partition into param_groups only around its step
        # and keys the inner optimizer's state by that partition tensor.
        assert all(not g["params"] for g in inner.param_groups), \
            "ZeRO 3 no longer empties the inner optimizer's param_groups between steps"
        for attr in ("fp16_partitioned_groups_flat", "dp_process_group"):
            assert hasattr(opt, attr), f"DeepSpeedZeroOptimizer_Stage3.{attr} is gone"
        bit16_dtype = opt.fp16_partitioned_groups_flat[0].dtype
    assert all(p.dtype == torch.float32 for p in parts), "fp32 master partitions are not fp32"
    assert bit16_dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32), bit16_dtype
    for attr in ("data_parallel_group",):
        assert hasattr(engine, attr), f"DeepSpeedEngine.{attr} is gone"

    tokens = torch.randint(0, 256, (2, 16))
    loss = engine(tokens, tokens)
    engine.backward(loss)
    engine.step()
    assert all(any(k is p for p in parts) for k in inner.state), \
        "the inner optimizer's state is no longer keyed by the fp32 partition tensors"
    # DeepSpeed's default AdamW (no torch_adam) is FusedAdam, on CPU its fused_adam op; its step is
    # a Python int (captured as plain state), torch's is a tensor.
    torch_adam = ds["optimizer"]["params"].get("torch_adam", False)
    expected = "AdamW" if torch_adam else "FusedAdam"
    assert type(inner).__name__ == expected, f"the inner optimizer is {type(inner).__name__}, not {expected}"
    for part in parts:
        entries = inner.state[part]
        assert sorted(entries) == ["exp_avg", "exp_avg_sq", "step"], f"inner state keys are {sorted(entries)}"
        assert isinstance(entries["step"], torch.Tensor if torch_adam else int), type(entries["step"])
    if not torch_adam:
        for attr in ("multi_tensor_adam", "_dummy_overflow_buf", "adam_w_mode"):
            assert hasattr(inner, attr), f"FusedAdam.{attr} is gone (hotspare.integrations.optim_state reads it)"
    if stage == 3:
        assert len(opt.sub_group_to_group_id) == len(parts), "ZeRO 3's sub_group_to_group_id moved"
    state = optimizer_state_tensors(engine)
    for n, t in state:
        if not n.endswith("step"):
            part = parts[int(n.split(".")[0])]
            assert t.shape == part.shape, f"optimizer state {n} is not shaped like its fp32 partition"
    # Partitions are equal-sized across ranks and together cover every parameter.
    numel = torch.tensor([sum(p.numel() for p in parts)])
    sizes = [torch.zeros_like(numel) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, numel)
    assert len({int(s) for s in sizes}) == 1, f"partition sizes differ across ranks: {sizes}"
    assert sum(int(s) for s in sizes) >= model.num_params()
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"optimizer": name, "partition_numel": int(numel), "num_params": model.num_params(),
                       "world_size": dist.get_world_size()}, f)
    session.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
