"""Hugging Face transformers models for tests and recipes, built from config objects only.

Nothing is downloaded: every model is a random initialisation of a small config of a real
architecture family, so the code under test is transformers' own modelling code.
- ``hf_gpt2``: GPT-2 (tied input and output embeddings, Conv1D projections, dropout on).
- ``hf_llama``: the Llama architecture (RoPE, RMSNorm, SwiGLU MLP, untied head).
- ``hf_opt``: OPT (learned positions with an offset, ReLU MLP, pre-LayerNorm, tied head).
"""
from __future__ import annotations

import torch

FAMILIES = ("hf_gpt2", "hf_llama", "hf_opt")


def build(family: str, *, vocab_size: int = 256, hidden_size: int = 32, num_layers: int = 1, num_heads: int = 2,
          seq_len: int = 16, dropout: float = 0.1) -> torch.nn.Module:
    """A randomly initialised transformers causal LM of ``family`` (seeded by the caller)."""
    import transformers

    if family == "hf_gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=hidden_size,
                                      n_layer=num_layers, n_head=num_heads, resid_pdrop=dropout, embd_pdrop=dropout,
                                      attn_pdrop=dropout, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
        cls = transformers.GPT2LMHeadModel
    elif family == "hf_llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                       num_hidden_layers=num_layers, num_attention_heads=num_heads,
                                       num_key_value_heads=num_heads, max_position_embeddings=seq_len,
                                       attention_dropout=dropout, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    elif family == "hf_opt":
        cfg = transformers.OPTConfig(vocab_size=vocab_size, hidden_size=hidden_size, ffn_dim=2 * hidden_size,
                                     num_hidden_layers=num_layers, num_attention_heads=num_heads,
                                     max_position_embeddings=seq_len, word_embed_proj_dim=hidden_size,
                                     dropout=dropout, attention_dropout=dropout)
        cls = transformers.OPTForCausalLM
    else:
        raise ValueError(f"model family {family!r}: choose one of {', '.join(FAMILIES)}")
    cfg._attn_implementation = "eager"  # the same kernels everywhere: bitwise comparisons across processes
    model = cls(cfg)
    model.train()
    return model


def loss(engine_or_model, tokens: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss of ``tokens`` (labels are the inputs; transformers shifts them)."""
    return engine_or_model(input_ids=tokens, labels=tokens).loss


def first_block(model: torch.nn.Module) -> torch.nn.Module:
    """The first transformer block of the project's GPT or of a transformers model (fault hooks)."""
    for path in ("blocks", "transformer.h", "model.layers", "model.decoder.layers"):
        obj = model
        try:
            for name in path.split("."):
                obj = getattr(obj, name)
        except AttributeError:
            continue
        return obj[0]
    raise ValueError(f"no transformer blocks found in {type(model).__name__}")


def model_and_loss(cfg):
    """(model, loss(engine, tokens, targets)) for a recipe's model shape ``cfg``
    (:class:`hotspare.testing.gpt.GPTConfig`): the project's GPT, or its ``family`` of transformers
    built from the same shape (which shifts the labels itself: ``targets`` is not used)."""
    from .gpt import GPT

    if cfg.family == "gpt":
        return GPT(cfg), lambda engine, tokens, targets: engine(tokens.to(engine.device), targets.to(engine.device))
    model = build(cfg.family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                  num_heads=cfg.num_heads, seq_len=cfg.seq_len, dropout=cfg.dropout)
    return model, lambda engine, tokens, _targets: loss(engine, tokens.to(engine.device))
