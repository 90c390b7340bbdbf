"""Worker for tests/test_rebuild.py: builds a ZeRO engine for rank R of W inside torch's fake
process group (no peers, collectives do nothing), as a spare will before it joins the real
generation. Prints the partition sizes and the groups the rebuild would re-point, as JSON."""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch.distributed as dist


def main(stage: int, rank: int, world: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    from hotspare.env import configure_accelerator

    configure_accelerator()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    import deepspeed
    import deepspeed.utils.groups
    from tiny import tiny_model_and_config

    from hotspare import rebuild
    from hotspare.integrations.deepspeed import fp32_partitions

    model, ds = tiny_model_and_config(stage)
    deepspeed.init_distributed("gloo")
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    records = rebuild.find_groups([engine, deepspeed.utils.groups])
    print(json.dumps({"partitions": [p.numel() for p in fp32_partitions(engine)], "num_params": model.num_params(),
                      "groups": [[list(r.ranks), r.backend] for r in records]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
