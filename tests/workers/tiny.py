"""The tiny GPT and ZeRO config the DeepSpeed test workers share."""
from __future__ import annotations

import warnings

from hotspare.env import make_deterministic
from hotspare.testing.gpt import GPT, GPTConfig


def tiny_model_and_config(stage: int, lr: float = 1e-3, **extra):
    """(model, DeepSpeed config) for a 1-layer GPT on ZeRO ``stage``; deterministic, quiet."""
    warnings.filterwarnings("ignore")
    make_deterministic(0)
    import deepspeed

    deepspeed.utils.logger.setLevel("ERROR")
    model = GPT(GPTConfig(num_layers=1, hidden_size=32, num_heads=2, seq_len=16))
    ds = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
          "zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000}, **extra}
    return model, ds
