"""Worker for tests/test_megatron_pipeline.py: megatron-core 0.16.1 on CPU/gloo through the shim,
PP=2 x DP=2 (4 ranks started by hotspare-run), megatron-core's GPTModel (local layer spec, tied
embeddings) split into two stages, megatron-core DDP and the distributed optimizer (Adam),
the 1F1B schedule with 4 microbatches, a cosine OptimizerParamScheduler.

Usage: megatron_pp.py OUT ITERS [ROUNDTRIP]. With ROUNDTRIP = i >= 0, every rank snapshots its
unique state (hotspare.integrations.megatron.MegatronState, into a snapshot buffer as the mirror
does) after iteration i, runs iteration i+1, wrecks its shards, Adam moments, scheduler and RNG,
restores the snapshot and runs iteration i+1 again. Writes OUT/rank<R>.json: per-iteration
losses (last stage; a replay overwrites), the digest of the rank's fp32 shard and Adam
moments, the scheduler's step count.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

from hotspare import env
from hotspare.generation import Generation, join, store_from_env
from hotspare.integrations.megatron import MegatronState, check_version, distributed_optimizers
from hotspare.snapshot import Layout, write_meta
from hotspare_patches import megatron_core_cpu

VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES, HIDDEN, LAYERS, HEADS, SEED = 128, 16, 2, 4, 32, 4, 4, 1234


def main(out: str, iters: int, roundtrip: int = -1) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    megatron_core_cpu.apply()
    check_version()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    rank, world = env.env_int("RANK", 0), env.env_int("WORLD_SIZE", 1)
    join(store_from_env(), Generation(0, rank, world), "gloo", 60.0)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    pp_rank, dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    seed = SEED + 100 * pp_rank  # Megatron-LM's per-stage seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)

    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            ffn_hidden_size=4 * HIDDEN, hidden_dropout=0.1, attention_dropout=0.1,
                            pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                            params_dtype=torch.float32, use_cpu_initialization=True, bias_activation_fusion=False,
                            bias_dropout_fusion=False, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                            deterministic_mode=True)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute")
    model = DistributedDataParallel(config=cfg, module=model, ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=4096))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01, adam_beta2=0.95, clip_grad=1.0,
        use_distributed_optimizer=True, params_dtype=torch.float32), [model])
    samples = MICRO_BATCH * MICRO_BATCHES * ps.get_data_parallel_world_size()
    sched = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2 * samples,
                                    lr_decay_steps=20 * samples, lr_decay_style="cosine", start_wd=0.01,
                                    end_wd=0.01, wd_incr_steps=20 * samples, wd_incr_style="constant")
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = model.no_sync
    cfg.grad_scale_func = optimizer.scale_loss

    def batches(it: int):
        for mb in range(MICRO_BATCHES):
            g = torch.Generator().manual_seed(SEED * 1_000_003 + it * 1009 + mb * 31 + dp_rank)
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def forward_step(data, model):
        tokens, labels = next(data)
        positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ).contiguous()
        output = model(tokens, positions, None, labels=labels)

        def loss_func(per_token):
            loss = per_token.float().sum()
            count = torch.tensor(per_token.numel(), dtype=torch.int)
            return loss, count, {"lm loss": torch.stack([loss.detach().clone(), count.float()])}

        return output, loss_func

    forward_backward = get_forward_backward_func()
    state = MegatronState([model], optimizer, sched)
    losses, snapshot, replayed = {}, None, False
    it = -1
    while it + 1 < iters:
        it += 1
        if roundtrip >= 0 and it == roundtrip + 1 and snapshot is None:
            named = state.tensors()
            layout = Layout.of(named)
            snapshot = layout.allocate()
            for view, (_, t) in zip(layout.views(snapshot), named):
                view.copy_(t.reshape(-1))
            write_meta(snapshot, layout, state.meta())
        elif roundtrip >= 0 and it == roundtrip + 2 and not replayed:
            replayed = True
            with torch.no_grad():  # wreck everything the snapshot must bring back
                for do in distributed_optimizers(optimizer):
                    for group in do.optimizer.param_groups:
                        for p in group["params"]:
                            p.add_(1.0)
                            for v in do.optimizer.state[p].values():
                                v.mul_(3.0)
            sched.step(12345)
            torch.manual_seed(999)
            state.restore(snapshot, layout)
            state.resync()
            it = roundtrip + 1
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(forward_step_func=forward_step, data_iterator=batches(it), model=[model],
                                   num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                   forward_only=False)
        ok, _grad_norm, _ = optimizer.step()
        assert ok, f"iteration {it}: the optimizer step was skipped"
        sched.step(increment=samples)
        if ps.is_pipeline_last_stage():
            total = torch.stack([d["lm loss"] for d in reduced]).sum(0)
            losses[it] = float(total[0] / total[1]).hex()
    h = hashlib.sha256()
    for do in optimizer.chained_optimizers:
        for group in do.shard_fp32_groups:
            for p in group:
                h.update(p.detach().contiguous().numpy().tobytes())
                state = do.optimizer.state[p]
                h.update(state["exp_avg"].numpy().tobytes())
                h.update(state["exp_avg_sq"].numpy().tobytes())
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "pp": pp_rank, "dp": dp_rank, "losses": losses, "state": h.hexdigest(),
                   "sched_steps": sched.num_steps, "redirects": megatron_core_cpu.redirects()}, f)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else -1)
