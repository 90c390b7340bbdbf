"""A compact, deterministic GPT for hotspare's smoke tests and recipes.

Byte-level (vocab 256), pre-norm transformer blocks, learned positions, untied head.
Attention is written out (masked softmax of q.k) rather than using fused kernels so the
CPU run is bitwise reproducible with ``torch.use_deterministic_algorithms(True)`` and
the same code runs on any accelerator DeepSpeed supports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Shape of the smoke-test GPT."""

    num_layers: int = 2
    """Number of transformer blocks."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size."""
    seq_len: int = 64
    """Context length in bytes."""
    dropout: float = 0.1
    """Dropout probability (exercises the RNG state that recovery must restore)."""
    vocab_size: int = 256
    """Byte-level vocabulary."""
    family: str = "gpt"
    """The architecture built from this shape: gpt (this module's) or a transformers family of
    :mod:`hotspare.testing.hf` (hf_gpt2, hf_llama, hf_opt)."""

    def __post_init__(self) -> None:
        if self.family not in ("gpt", "hf_gpt2", "hf_llama", "hf_opt"):
            raise ValueError(f"model.family={self.family!r}: choose gpt, hf_gpt2, hf_llama or hf_opt")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads="
                f"{self.num_heads}; pick a head count that divides the width")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")


class CausalSelfAttention(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
        # Not persistent: it is derived from the config, so it is neither mirrored nor saved.
        self.register_buffer("causal_mask", mask.view(1, 1, cfg.seq_len, cfg.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.num_heads, c // self.num_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.causal_mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att.float(), dim=-1).to(q.dtype))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size),
            nn.GELU(),
            nn.Linear(4 * cfg.hidden_size, cfg.hidden_size),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``forward(tokens, targets)`` returns the mean next-byte cross-entropy."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = tokens.size(1)
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
