"""DeepSpeed integration: ``hotspare.initialize`` (``deepspeed.initialize`` with the ``"hotspare"``
section), a ZeRO rank's unique state, and DeepSpeed's background checkpoint writer. The only
package of hotspare that imports DeepSpeed.

- :mod:`.session`: ``initialize`` and :class:`DeepSpeedSession`;
- :mod:`.state`: :class:`DeepSpeedState` (the ZeRO partitions, the optimizer's state, the
  engine's counters) and the start-up guard against state the capture misses;
- :mod:`.zero`: what a ZeRO step cut short leaves, cleared;
- :mod:`.warmup`: a spare's warm-up;
- :mod:`.checkpoint_engine`: DeepSpeed's torch checkpoint engine writing in the background.
"""
from ...startup import default_group_timeout, node_ranks
from .session import DeepSpeedSession, check_version, initialize
from .state import DeepSpeedState, fp32_partitions, optimizer_state_tensors, partition_groups, persistent_buffers
from .warmup import LAZY_IMPORTS, optimizer_ops, warm_up_spare

__all__ = ["DeepSpeedSession", "DeepSpeedState", "LAZY_IMPORTS", "check_version", "default_group_timeout",
           "fp32_partitions", "initialize", "node_ranks", "optimizer_ops", "optimizer_state_tensors",
           "partition_groups", "persistent_buffers", "warm_up_spare"]
