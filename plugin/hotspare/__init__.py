"""hotspare: in-place failure recovery for DeepSpeed and Megatron-core training.

``hotspare.initialize`` is ``deepspeed.initialize`` plus hotspare; see README.md.
"""
from __future__ import annotations

from .errors import FatalError, HotspareError, RecoverableError
from .position import STEP_INDEXED, DataPosition, skip

__all__ = ["DataPosition", "FatalError", "HotspareError", "RecoverableError", "STEP_INDEXED", "initialize", "skip"]
__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """See :func:`hotspare.integrations.deepspeed.initialize`."""
    from .integrations.deepspeed import initialize as _initialize

    return _initialize(*args, **kwargs)
