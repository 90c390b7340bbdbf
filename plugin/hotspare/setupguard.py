"""A spare's set-up after ``initialize``: collectives there would wait for ranks that are training.

A script's code between ``initialize`` and its training loop (megatron-core's dataset builders,
a tokenizer broadcast, a barrier) runs on every rank at the start of the job. A spare runs it
after its takeover, when the survivors are back in their training loop and will never call the
matching collective: the spare would hang until the collective timeout, and the next spare the
same way. So on a spare, from ``initialize``'s return to the first step of its loop, on the
thread that called ``initialize``:
- ``torch.distributed.barrier`` returns at once (the other ranks passed it at the start of the
  job; megatron-core's ``BlendedMegatronDatasetBuilder.build`` has one so that rank 0 builds
  the index files first, which exist by now);
- any other collective raises :class:`SpareSetupError` naming the call and what to do, after
  telling the coordinator (``unfit/<worker>``), which stops the job when two spares fail the same
  way instead of burning every spare.
hotspare's own threads (the mirror's) are not affected.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch.distributed as dist

from .events import log
from .recovery import RecoveryError

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "reduce",
               "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "monitored_barrier")


class SpareSetupError(RecoveryError):
    """A spare's set-up code called a collective the training ranks will never join."""


class SetupGuard:
    """Installed on a spare by ``initialize``; :meth:`stop` at the loop's first step (idempotent)."""

    def __init__(self, report: Callable[[str], None] = lambda message: None):
        self._report = report
        self._thread = threading.get_ident()
        self._saved: dict[str, Callable] = {}
        self.skipped_barriers = 0

    def start(self) -> "SetupGuard":
        for name in ("barrier", *COLLECTIVES):
            original = getattr(dist, name, None)
            if original is not None:
                self._saved[name] = original
                setattr(dist, name, self._wrap(name, original))
        return self

    def stop(self) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved = {}

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def _wrap(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def guarded(*args, **kwargs):
            if threading.get_ident() != self._thread:
                return original(*args, **kwargs)
            if name == "barrier":
                if not self.skipped_barriers:
                    log("a spare skips torch.distributed.barrier() in the script's set-up after initialize: the "
                        "training ranks passed it at the start of the job")
                self.skipped_barriers += 1
                return None
            message = (f"this spare's script called torch.distributed.{name}() after initialize and before its "
                       f"training loop; the other ranks ran that set-up at the start of the job and are training "
                       f"now, so they will never join it. Run collectives of the set-up before initialize, or skip "
                       f"them on a spare (session.spare is True there)")
            self._report(message)
            self.stop()
            raise SpareSetupError(message)

        return guarded
