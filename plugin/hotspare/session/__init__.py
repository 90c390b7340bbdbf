"""A training process's hotspare session (:class:`Session`) and what happens to it at a failure.

- :mod:`.core`: the session, its training-loop API and the hooks each host framework fills in;
- :mod:`.landing`: one recovery, from leaving the failed generation to resuming in the next;
- :mod:`.sources`: where the restored state comes from (self, keeper, peers, stripe, checkpoint);
- :mod:`.protection`: hotspare's groups, placement, the keeper's buffers, the mirror's start.
"""
from .core import Session
from .landing import CatchUp, agree_on

__all__ = ["Session", "CatchUp", "agree_on"]
