"""megatron-core's GPT for the Megatron path of the recipes and tests: megatron-core's GPTModel
(local layer spec, tied embeddings, learned positions, dropout) split into pipeline stages,
megatron-core DDP with the distributed optimizer (Adam), an OptimizerParamScheduler, and one
training iteration with the pipeline schedule from ``get_forward_backward_func`` (1F1B).

Needs megatron-core (and, on CPU, ``hotspare_patches.megatron_core_cpu.apply()`` first), with
``parallel_state`` set up: :func:`hotspare.integrations.megatron.initialize` calls ``build``
after it has.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .gpt import GPTConfig


@dataclass
class MegatronTrain:
    """The optimizer, schedule and batch shape of a Megatron GPT job."""

    micro_batch: int = 8
    """Sequences per microbatch."""
    microbatches: int = 4
    """Microbatches per iteration (the 1F1B schedule's pipeline depth is filled by these)."""
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup_steps: int = 30
    """Warm-up iterations (linear from 0 to ``lr``), then linear decay to ``min_lr``."""
    decay_steps: int = 300
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 1234
    bucket_size: int = 40_000
    """DDP bucket size (elements): several buckets make reductions start mid-backward."""


def samples_per_iteration(t: MegatronTrain) -> int:
    from megatron.core import parallel_state as ps

    return t.micro_batch * t.microbatches * ps.get_data_parallel_world_size()


def build(model_cfg: GPTConfig, t: MegatronTrain, gloo_groups: bool = False):
    """(model chunks, optimizer, scheduler) of this rank's pipeline stage; seeds every generator
    first (Megatron-LM's per-stage seed), so a spare builds what the rank it takes built.

    With a virtual pipeline (``initialize_model_parallel(virtual_pipeline_model_parallel_size=V)``)
    the stage is V chunks, one per virtual stage, for the interleaved 1F1B schedule; only the
    first chunk's DDP buckets its gradients (Megatron-LM's convention)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    seed = t.seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    on_gpu = torch.cuda.is_available()
    virtual = ps.get_virtual_pipeline_model_parallel_world_size()
    cfg = TransformerConfig(num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
                            num_attention_heads=model_cfg.num_heads, ffn_hidden_size=4 * model_cfg.hidden_size,
                            hidden_dropout=model_cfg.dropout, attention_dropout=model_cfg.dropout,
                            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                            virtual_pipeline_model_parallel_size=virtual,
                            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                            pipeline_dtype=torch.float32, params_dtype=torch.float32,
                            use_cpu_initialization=not on_gpu, bias_activation_fusion=False,
                            bias_dropout_fusion=False, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                            deterministic_mode=True)
    chunks = []
    for vp_stage in range(virtual or 1):
        vp = None if virtual is None else vp_stage
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=model_cfg.vocab_size, max_sequence_length=model_cfg.seq_len,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                         share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute",
                         vp_stage=vp)
        if on_gpu:
            model.cuda(torch.cuda.current_device())
        chunks.append(DistributedDataParallel(config=cfg, module=model, ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=t.bucket_size),
            disable_bucketing=vp_stage > 0))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
        clip_grad=t.grad_clip, use_distributed_optimizer=True, params_dtype=torch.float32), chunks,
        use_gloo_process_groups=gloo_groups)
    samples = samples_per_iteration(t)
    sched = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
                                    lr_warmup_steps=t.warmup_steps * samples,
                                    lr_decay_steps=max(t.decay_steps, t.warmup_steps + 1) * samples,
                                    lr_decay_style="linear", start_wd=t.weight_decay, end_wd=t.weight_decay,
                                    wd_incr_steps=max(t.decay_steps, 1) * samples, wd_incr_style="constant")
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    cfg.grad_scale_func = optimizer.scale_loss
    return chunks, optimizer, sched


def forward_step(data: Iterator, model):
    """megatron-core's forward-step contract: (output, loss function) for the next microbatch."""
    tokens, labels = next(data)
    batch, seq = tokens.shape
    device = tokens.device
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq).contiguous()
    output = model(tokens, positions, None, labels=labels)

    def loss_func(per_token):
        loss = per_token.float().sum()
        count = torch.tensor(per_token.numel(), dtype=torch.int, device=loss.device)
        return loss, count, {"lm loss": torch.stack([loss.detach().clone(), count.float()])}

    return output, loss_func


def train_iteration(model: list, optimizer, sched, batches: Iterator, t: MegatronTrain, seq_len: int,
                    forward: Callable = forward_step, before_step: Callable[[], None] | None = None) -> float | None:
    """One iteration (every microbatch, the optimizer and scheduler step); returns the mean
    per-token loss on the last pipeline stage, None on the others. ``before_step`` runs after
    the last backward, before the optimizer step. With several chunks (a virtual pipeline) each
    chunk reads the microbatches from an iterator of its own."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if len(model) > 1:  # interleaved: each chunk reads every microbatch from an iterator of its own
        items = list(batches)
        batches = [iter(items) for _ in model]
    reduced = get_forward_backward_func()(forward_step_func=forward, data_iterator=batches, model=model,
                                          num_microbatches=t.microbatches, seq_length=seq_len,
                                          micro_batch_size=t.micro_batch, forward_only=False)
    if before_step is not None:
        before_step()
    ok, _grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("the optimizer step was skipped (a non-finite gradient)")
    sched.step(increment=samples_per_iteration(t))
    if ps.is_pipeline_last_stage():
        total = torch.stack([d["lm loss"] for d in reduced]).sum(0)
        return float(total[0] / total[1])
    return None


def shard_tensors(optimizer) -> list[torch.Tensor]:
    """This rank's fp32 shards, in a fixed order."""
    return [p for do in optimizer.chained_optimizers for group in do.shard_fp32_groups for p in group]


def moment_tensors(optimizer) -> list[torch.Tensor]:
    """Adam's moments of this rank's shards, in the same order."""
    out = []
    for do in optimizer.chained_optimizers:
        for group in do.shard_fp32_groups:
            for p in group:
                state = do.optimizer.state[p]
                out += [state["exp_avg"], state["exp_avg_sq"]]
    return out

