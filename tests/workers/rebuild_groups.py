"""Worker for tests/test_rebuild.py: trains a ZeRO engine, then (mode 'rebuild') destroys every
process group, joins generation 1 on the same control store, re-points every group handle
DeepSpeed holds to new groups (hotspare.rebuild, through the references its walk recorded) and
trains on. Writes the per-step losses
and digests (the host-view one among them), and what the rebuild found, to OUT/rank<R>.json."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import hotspare
from hotspare import rebuild
from hotspare.generation import Generation, join, leave
from hotspare.integrations.deepspeed import fp32_partitions, optimizer_state_tensors
from hotspare.testing import digest, statedigest
from tiny import tiny_model_and_config



def main(stage: int, mode: str, out: str) -> None:
    import deepspeed.comm.comm
    import deepspeed.utils.groups

    model, ds = tiny_model_and_config(stage, lr=1e-2)
    session = hotspare.initialize(model=model, config=ds, model_parameters=model.parameters())
    engine, rank, world = session.engine, dist.get_rank(), dist.get_world_size()
    roots = [engine, deepspeed.utils.groups, deepspeed.comm.comm]
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(4)]
    losses, found = [], {}
    for step, tokens in enumerate(batches):
        if step == 2 and mode == "rebuild":
            records = rebuild.find_groups(roots)
            found["before"] = [[list(r.ranks), r.was_default] for r in records]
            old = [r.group for r in records]
            leave()
            join(session.store, Generation(1, rank, world), "gloo", 60)
            rebuild.check_signature(records, world)
            # Through the references the walk recorded (what a recovery does), then a fresh walk
            # must find no old group left.
            found["replaced"] = rebuild.repoint_records(records, rebuild.create_groups(records, 60, backend="gloo"))
            found["refs"] = sum(len(r.refs) for r in records)
            after = rebuild.find_groups(roots)
            found["old_left"] = sum(1 for r in after if any(r.group is g for g in old))
            found["after"] = len(after)
        loss = engine(tokens, tokens)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss).hex())
    result = {"losses": losses, "fp32": digest(fp32_partitions(engine)),
              "optim": digest(t for _, t in optimizer_state_tensors(engine)), "found": found,
              "state": statedigest.deepspeed_engine(engine)}
    session.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
