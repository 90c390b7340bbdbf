"""The tiny GPT and ZeRO config the DeepSpeed test workers share."""
from __future__ import annotations

import os
import warnings

from hotspare.env import make_deterministic
from hotspare.testing.gpt import GPT, GPTConfig


def optimizer_config(lr: float) -> dict:
    """DeepSpeed's own AdamW (its default implementation: the fused_adam op on CPU) unless
    HS_TEST_OPTIMIZER=torch_adam asks for torch's."""
    params = {"lr": lr}
    if os.environ.get("HS_TEST_OPTIMIZER", "default") == "torch_adam":
        params["torch_adam"] = True
    return {"type": "AdamW", "params": params}


def tiny_model_and_config(stage: int, lr: float = 1e-3, **extra):
    """(model, DeepSpeed config) for a 1-layer GPT on ZeRO ``stage``; deterministic, quiet."""
    warnings.filterwarnings("ignore")
    make_deterministic(0)
    import deepspeed

    deepspeed.utils.logger.setLevel("ERROR")
    model = GPT(GPTConfig(num_layers=1, hidden_size=32, num_heads=2, seq_len=16))
    ds = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
          "optimizer": optimizer_config(lr),
          "zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000}, **extra}
    return model, ds
