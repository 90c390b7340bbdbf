"""The megatron-core GPT of the Megatron tests (hotspare.testing.mcore_gpt at a tiny size): PP=2,
4 microbatches of random tokens that are a function of (iteration, microbatch, data-parallel
rank), so a re-run iteration sees the same ones."""
from __future__ import annotations

import torch

from hotspare.testing import mcore_gpt
from hotspare.testing.gpt import GPTConfig

PP = 2
MODEL = GPTConfig(num_layers=4, hidden_size=32, num_heads=4, seq_len=16, dropout=0.1, vocab_size=128)
TRAIN = mcore_gpt.MegatronTrain(micro_batch=2, microbatches=4, lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=20,
                                weight_decay=0.01, grad_clip=1.0, seed=1234, bucket_size=4096)
forward_step = mcore_gpt.forward_step


def build(gloo_groups: bool = True):
    return mcore_gpt.build(MODEL, TRAIN, gloo_groups=gloo_groups)


def batches(it: int):
    from megatron.core import parallel_state as ps

    dp_rank = ps.get_data_parallel_rank()
    for mb in range(TRAIN.microbatches):
        g = torch.Generator().manual_seed(TRAIN.seed * 1_000_003 + it * 1009 + mb * 31 + dp_rank)
        tokens = torch.randint(0, MODEL.vocab_size, (TRAIN.micro_batch, MODEL.seq_len + 1), generator=g)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_iteration(model, optimizer, sched, it: int, forward=forward_step) -> str | None:
    """One iteration; the last stage's mean loss as float.hex, None on the other stages."""
    loss = mcore_gpt.train_iteration(model, optimizer, sched, batches(it), TRAIN, MODEL.seq_len, forward=forward)
    return None if loss is None else float(loss).hex()
