"""megatron-core: mirroring and in-place recovery of a pipeline-parallel x data-parallel job.

:func:`initialize` sets up ``parallel_state`` and the caller's model, optimizer and scheduler
(built by the caller's ``build`` function, so that a spare builds the rank it takes) and
returns a :class:`MegatronSession`; :class:`MegatronState` is what the mirror, keeper and
restore need from a rank (the razor, as :class:`hotspare.integrations.deepspeed.DeepSpeedState`
does for ZeRO). At a recovery every ``parallel_state`` group is made anew for the new
generation by ``initialize_model_parallel`` with the job's arguments, and every handle the
model and optimizer hold (DDP, its buckets, the distributed optimizer's own bucket groups, the
model's ``pg_collection`` and per-layer ``tp_group``...) is re-pointed by global name.

Where megatron-core 0.16.1 keeps it (pinned by tests/test_megatron_pipeline.py):

- ``get_megatron_optimizer`` returns a ``ChainedOptimizer``; each of its
  ``chained_optimizers`` is a ``DistributedOptimizer`` whose ``shard_fp32_groups`` (fp32
  parameters) and ``shard_fp32_from_float16_groups`` (fp32 masters of bf16/fp16 ones) are this
  data-parallel rank's 1/d of its stage's parameters; with fp32 parameters the shards are
  views into DDP's parameter buffer;
- the inner torch optimizer's ``state[shard]`` holds Adam's ``step``, ``exp_avg`` and
  ``exp_avg_sq`` for each shard;
- ``OptimizerParamScheduler``'s only moving state is ``num_steps`` (``load_state_dict`` adds
  to it, so it is set, then ``step(0)`` recomputes the learning rate and weight decay);
- the RNG: torch's default generator, the tracker's named states (dropout), Python's and
  NumPy's generators.

The stage's full weights are not unique: after the shards are restored, every data-parallel
rank all-gathers them (:meth:`MegatronState.resync`).

Modules: :mod:`.setup` (``initialize``: the process group, ``parallel_state``, the caller's
build and its checks, a spare's warm-up), :mod:`.session` (:class:`MegatronSession`: the loop,
the persistent checkpoint, the groups' rebuild), :mod:`.state` (:class:`MegatronState`).
"""
from .session import MegatronSession, parallel_state_groups, warm_up_checkpoint_writer
from .setup import (LAZY_IMPORTS, SUPPORTED_MEGATRON, build_checked, check_optimizer, check_version, initialize,
                    parse_config, warm_up_spare)
from .state import CHECKPOINT_METADATA, MegatronState, distributed_optimizers, extras_file, shards

__all__ = ["CHECKPOINT_METADATA", "LAZY_IMPORTS", "MegatronSession", "MegatronState", "SUPPORTED_MEGATRON",
           "build_checked", "check_optimizer", "check_version", "distributed_optimizers", "extras_file", "initialize",
           "parallel_state_groups", "parse_config", "shards", "warm_up_checkpoint_writer", "warm_up_spare"]
