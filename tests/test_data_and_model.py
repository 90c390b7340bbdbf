"""The smoke GPT and its data: the shipped corpus, the stateless sampler, deterministic init.
Single process, CPU."""
from __future__ import annotations

import math

import torch

from hotspare.testing.data import ByteSampler, load_corpus
from hotspare.testing.gpt import GPT, GPTConfig


def test_corpus_ships_with_the_package():
    corpus = load_corpus()
    assert corpus.dtype == torch.uint8 and corpus.numel() > 40_000
    assert int(corpus.max()) < 128  # ASCII text


def test_sampler_is_a_function_of_step_and_rank():
    corpus = load_corpus()
    a, b = ByteSampler(corpus, 16, 4, seed=7), ByteSampler(corpus, 16, 4, seed=7)
    x, y = a.batch(step=5, dp_rank=2)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    # Same (seed, step, rank) -> same batch, whatever was drawn before; anything else differs.
    b.batch(0, 0), b.batch(9, 3)
    assert torch.equal(b.batch(5, 2)[0], x)
    assert not torch.equal(a.batch(5, 3)[0], x)
    assert not torch.equal(a.batch(6, 2)[0], x)
    assert not torch.equal(ByteSampler(corpus, 16, 4, seed=8).batch(5, 2)[0], x)


def test_gpt_init_is_deterministic_and_loss_starts_near_uniform():
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_heads=2, seq_len=16, dropout=0.0)
    torch.manual_seed(0)
    m1 = GPT(cfg)
    torch.manual_seed(0)
    m2 = GPT(cfg)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
    x, y = ByteSampler(load_corpus(), 16, 4, seed=0).batch(0, 0)
    loss = m1(x, y)
    assert abs(loss.item() - math.log(256)) < 0.2
    loss.backward()
    assert all(p.grad is not None for p in m1.parameters())
