"""Worker for tests/test_megatron_example.py: megatron-core's own example loop shape under hotspare.

What a user of megatron-core's example training loop has, moved onto
``hotspare.integrations.megatron.initialize`` with the fewest changes: a GPTModel (local spec)
in megatron-core DDP with the distributed optimizer, tensor parallel 2 x data parallel 2; the
data set built *after* initialize with ``BlendedMegatronDatasetBuilder(MockGPTDataset, ...)``
(whose ``build()`` calls ``torch.distributed.barrier()``: on a spare that runs after its
takeover, while the others train); a ``DataLoader`` iterator read with ``next()`` by the forward
step (its position carried by ``hotspare.DataPosition``); ``get_forward_backward_func`` and
``finalize_model_grads``. One rank SIGKILLs itself in a forward.

Usage: mcore_example.py OUT ITERS KILL, KILL = 'none' or 'RANK:ITER:MICRO'. HS_TEST_VARIANT=plain_adam
or gloo_default builds what hotspare refuses at initialize. Each process that
finishes writes OUT/<worker id>.json: losses by iteration, the digest of its shards and Adam
moments, the data position, its recoveries.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys

import torch

import hotspare
from hotspare.integrations import megatron
from hotspare.testing import mcore_gpt, statedigest
from hotspare.testing.gpt import GPTConfig
from hotspare.worker import worker_id
from hotspare_patches import megatron_core_cpu

MODEL = GPTConfig(num_layers=2, hidden_size=32, num_heads=4, seq_len=16, dropout=0.1, vocab_size=128)
TRAIN = mcore_gpt.MegatronTrain(micro_batch=2, microbatches=2, lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=20,
                                weight_decay=0.01, grad_clip=1.0, seed=1234, bucket_size=4096)


def datasets():
    """megatron-core's mock GPT data set, built as its example does (a barrier inside)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers import MegatronTokenizer

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=MODEL.vocab_size - 1)
    config = GPTDatasetConfig(random_seed=0, sequence_length=MODEL.seq_len, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, tokenizer=tokenizer)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True, config).build()


def forward_step(data_iterator, model, die=lambda: None):
    """The example's forward step: a dict batch from the iterator, a loss masked by loss_mask."""
    data = next(data_iterator)
    die()
    output = model(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["labels"])

    def loss_func(loss_mask, per_token):
        mask = loss_mask.view(-1).float()
        loss = torch.sum(per_token.float().view(-1) * mask)
        count = mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach().clone(), mask.sum()])}

    return output, functools.partial(loss_func, data["loss_mask"])


def main(out: str, iters: int, kill: str) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    megatron_core_cpu.apply()
    target = None if kill == "none" else tuple(int(x) for x in kill.split(":"))
    config = {"events_dir": os.path.join(out, "events"), "mirror": {"chunk_mb": 0.01, "timeout_s": 20.0},
              "recovery": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0, "collective_timeout_s": 30.0,
                           "rendezvous_timeout_s": 60.0}}
    position = hotspare.DataPosition()
    variant = os.environ.get("HS_TEST_VARIANT", "")

    def build():
        # The example's variants hotspare refuses: its plain torch Adam, and get_megatron_optimizer's
        # default gloo groups (use_gloo_process_groups=True) without asking initialize for them.
        chunks, optimizer, sched = mcore_gpt.build(MODEL, TRAIN, gloo_groups=variant == "gloo_default")
        if variant == "plain_adam":
            optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=TRAIN.lr)
        return chunks, optimizer, sched

    session = megatron.initialize(build, config, tensor_model_parallel_size=2,
                                  data_state=position.state, load_data_state=position.load)
    train_ds = datasets()[0]  # after initialize, as the example does: a spare runs it after its takeover
    loader_seed = TRAIN.seed

    def loader(start: int):
        order = torch.Generator().manual_seed(loader_seed)  # the same order each time it is built
        batches = torch.utils.data.DataLoader(train_ds, batch_size=TRAIN.micro_batch, shuffle=True, generator=order)
        return hotspare.skip(batches, start)

    data = position.iterate(loader)
    rank = session.generation.rank
    microbatch = [0]

    @session.resilient
    def train(it: int):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        microbatch[0] = 0

        def die():
            if target is not None and not session.spare and target == (rank, it, microbatch[0]):
                os.kill(os.getpid(), signal.SIGKILL)
            microbatch[0] += 1

        for chunk in session.model:
            chunk.zero_grad_buffer()
        session.optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=functools.partial(forward_step, die=die), data_iterator=data, model=session.model,
            num_microbatches=TRAIN.microbatches, seq_length=MODEL.seq_len, micro_batch_size=TRAIN.micro_batch,
            forward_only=False)
        ok, _, _ = session.optimizer.step()
        if not ok:
            raise RuntimeError("the optimizer step was skipped")
        session.scheduler.step(increment=mcore_gpt.samples_per_iteration(TRAIN))
        total = torch.stack([d["lm loss"] for d in reduced]).sum(0)
        return float(total[0] / total[1]).hex()

    losses = {}
    for it in session.steps(iters):
        loss = train(it)
        if loss is not None:
            losses[it] = loss
    from megatron.core import parallel_state as ps

    result = {"rank": rank, "worker": worker_id(), "spare": session.spare, "tp": ps.get_tensor_model_parallel_rank(),
              "losses": losses, "state": statedigest.megatron(session.model, session.optimizer, session.scheduler), "consumed": position.consumed,
              "iteration": session.state.iteration, "recoveries": session.recoveries}
    session.close()
    with open(os.path.join(out, f"{worker_id()}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
