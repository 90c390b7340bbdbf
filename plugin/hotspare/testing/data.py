"""Byte-level data for the smoke GPT: the corpus the package ships and a stateless sampler.

The sampler's batch is a pure function of (seed, step, data-parallel rank), so the whole
"data position" a rank needs to resume is the step it is on: a spare that takes over rank r
at step s draws exactly the batch rank r would have drawn.
"""
from __future__ import annotations

from importlib import resources

import numpy as np
import torch

CORPUS_PACKAGE = "hotspare.data"
CORPUS_FILE = "corpus.txt"


def load_corpus(path: str = "") -> torch.Tensor:
    """A text file's bytes as a uint8 tensor; the shipped public-domain corpus when ``path`` is empty."""
    if path:
        with open(path, "rb") as f:
            raw = f.read()
    else:
        raw = resources.files(CORPUS_PACKAGE).joinpath(CORPUS_FILE).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class ByteSampler:
    """Random windows of ``seq_len + 1`` bytes; batch = f(seed, step, dp_rank)."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if corpus.numel() <= seq_len + 1:
            raise ValueError(f"corpus of {corpus.numel()} bytes is shorter than seq_len+1={seq_len + 1}")
        self.corpus = corpus.long()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self._num_windows = corpus.numel() - seq_len - 1
        self._offsets = torch.arange(seq_len + 1)

    def batch(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each ``[batch_size, seq_len]`` int64, for this step and rank."""
        rng = np.random.default_rng([self.seed, step, dp_rank])
        starts = torch.from_numpy(rng.integers(0, self._num_windows, size=self.batch_size))
        windows = self.corpus[starts[:, None] + self._offsets[None, :]]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
