"""The tiny GPT and ZeRO config the DeepSpeed test workers share."""
from __future__ import annotations

import os
import random
import warnings

import numpy as np
import torch

from hotspare.env import make_deterministic
from hotspare.testing import hf
from hotspare.worker import role
from hotspare.testing.gpt import GPT, GPTConfig


OPTIMIZERS = ("default", "torch_adam", "offload", "adagrad_offload", "lion_offload", "adagrad", "client")


def optimizer_kind() -> str:
    """HS_TEST_OPTIMIZER: default (DeepSpeed's own AdamW: FusedAdam, the fused_adam op on CPU),
    torch_adam, offload (ZeRO-Offload: DeepSpeedCPUAdam), adagrad_offload (DeepSpeedCPUAdagrad),
    lion_offload (DeepSpeedCPULion), adagrad (torch's, from the JSON) or client (a torch AdamW
    passed to initialize)."""
    kind = os.environ.get("HS_TEST_OPTIMIZER", "default")
    if kind not in OPTIMIZERS:
        raise ValueError(f"HS_TEST_OPTIMIZER={kind!r}: one of {', '.join(OPTIMIZERS)}")
    return kind


def optimizer_config(lr: float) -> dict | None:
    """The JSON's optimizer section for :func:`optimizer_kind` (None for a client optimizer)."""
    kind = optimizer_kind()
    if kind == "client":
        return None
    params = {"lr": lr}
    if kind == "torch_adam":
        params["torch_adam"] = True
    name = {"adagrad_offload": "Adagrad", "adagrad": "Adagrad", "lion_offload": "Lion"}.get(kind, "AdamW")
    return {"type": name, "params": params}


def initialize_kwargs(model, lr: float) -> dict:
    """What the worker passes to hotspare.initialize besides the model and config."""
    if optimizer_kind() == "client":
        return {"optimizer": torch.optim.AdamW(model.parameters(), lr=lr)}
    return {"model_parameters": model.parameters()}


class Stats(torch.nn.Module):
    """The tiny GPT plus what a user's module may hold beside its trained parameters: a buffer
    updated in place from each rank's own data (a running statistic) that feeds the loss, and a
    frozen parameter initialised differently in every process (DeepSpeed's start-up broadcast
    makes rank 0's the job's; a spare must fetch it)."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
        # Active ranks seed by rank (rank 0's values, which DeepSpeed broadcasts, are the same in every
        # run); a spare by its pid: its own values are never the job's.
        seed = os.getpid() if role() == "spare" else 1000 + int(os.environ.get("RANK", "0"))
        noise = torch.randn(256, generator=torch.Generator().manual_seed(seed))
        self.frozen = torch.nn.Parameter(noise, requires_grad=False)
        self.register_buffer("running", torch.zeros(()))

    def forward(self, tokens, targets):
        loss = self.gpt(tokens, targets)
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * loss.detach())
        return loss * (1 + 0.01 * self.running) + 1e-3 * self.frozen[tokens].mean()


def model_name() -> str:
    """HS_TEST_MODEL: gpt (default; the project's tiny GPT), stats (:class:`Stats`) or a transformers
    family of hotspare.testing.hf (hf_gpt2, hf_llama, hf_opt)."""
    return os.environ.get("HS_TEST_MODEL", "gpt")


def batch(step: int, rank: int, micro: int) -> torch.Tensor:
    """The tokens of one micro-batch: a function of (step, rank, micro-batch) only, so a replayed
    step reads the same ones."""
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def loss_of(engine, tokens):
    """The micro-batch's loss, scaled by a draw from Python's and from NumPy's generator: users'
    data pipelines draw from both (augmentation, sampling), so a spare that did not get the dead
    rank's two generator states back trains on different gradients."""
    scale = 1 + 1e-2 * (random.random() + float(np.random.rand()))
    if model_name().startswith("hf_"):
        return hf.loss(engine, tokens) * scale
    return engine(tokens, tokens) * scale


def tiny_model_and_config(stage: int, lr: float = 1e-3, **extra):
    """(model, DeepSpeed config) for a 1-layer model on ZeRO ``stage``; deterministic, quiet.
    HS_TEST_DTYPE=bf16 trains in bf16; HS_TEST_EXTRAS=1 adds what users' configs carry: a WarmupLR
    schedule from the JSON and gradient clipping."""
    warnings.filterwarnings("ignore")
    make_deterministic(0)
    import deepspeed

    deepspeed.utils.logger.setLevel("ERROR")
    name = model_name()
    if name.startswith("hf_"):
        model = hf.build(name, hidden_size=32, num_layers=1, num_heads=2, seq_len=16)
    else:
        model = GPT(GPTConfig(num_layers=1, hidden_size=32, num_heads=2, seq_len=16))
        if name == "stats":
            model = Stats(model)
    ds = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
          "zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000}, **extra}
    if optimizer_config(lr) is not None:
        ds["optimizer"] = optimizer_config(lr)
    if optimizer_kind().endswith("offload"):
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if os.environ.get("HS_TEST_DTYPE") == "bf16":
        ds["bf16"] = {"enabled": True}
    if os.environ.get("HS_TEST_EXTRAS") == "1":
        ds["gradient_clipping"] = 1.0
        ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                          "warmup_num_steps": 4}}
    return model, ds
