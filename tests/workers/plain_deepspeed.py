"""The reference without hotspare: tests/workers/recover.py's model, config, data and loop on
plain DeepSpeed (``deepspeed.initialize``, no ``hotspare`` section, started by torchrun), as a
user runs it before adding hotspare.

Usage: plain_deepspeed.py STAGE OUT ACCUM STEPS. Each rank writes OUT/rank<R>.json: its losses by
step, its state digest (hotspare.testing.statedigest, DeepSpeed's own view) and global_steps.
"""
from __future__ import annotations

import json
import os
import sys

from hotspare.testing import statedigest
from tiny import batch, initialize_kwargs, loss_of, tiny_model_and_config


def main(stage: int, out: str, accum: int, steps: int) -> None:
    model, ds = tiny_model_and_config(stage, lr=1e-2, gradient_accumulation_steps=accum)
    ds["zero_optimization"]["reduce_bucket_size"] = 2048  # as recover.py
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=ds, **initialize_kwargs(model, 1e-2))
    rank = engine.global_rank
    losses = {}
    for step in range(steps):
        for micro in range(accum):
            loss = loss_of(engine, batch(step, rank, micro))
            engine.backward(loss)
            engine.step()
        losses[step] = float(loss).hex()
    result = {"rank": rank, "losses": losses, "global_steps": engine.global_steps,
              "state": statedigest.deepspeed_engine(engine)}
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
