"""DeepSpeed's torch checkpoint engine with the writes moved to a background thread: the
persistent checkpoint (the last tier, :mod:`hotspare.checkpoint`) written off the critical path.

``engine.save_checkpoint`` stays DeepSpeed's: the files and their layout are DeepSpeed's own
(``<dir>/<tag>/mp_rank_00_model_states.pt``, ``zero_pp_rank_<R>_mp_rank_00_optim_states.pt``,
...), and ``engine.load_checkpoint(dir, tag)`` reads them. What changes is the engine DeepSpeed
writes through: ``save`` takes a host copy of each state dict (the only part on the step's
path) and a writer thread does the ``torch.save``, then the rank's completion marker.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable

import torch

from ... import checkpoint


def make_engine(rank: int, world_size: int, keep: int, on_event: Callable | None = None):
    """A background-writing checkpoint engine for ``engine.checkpoint_engine``."""
    return engine_class()(rank, world_size, keep, on_event)


@functools.cache
def engine_class() -> type:
    """The engine class, defined on first use: it subclasses DeepSpeed's torch engine, and
    importing DeepSpeed before the accelerator is configured would pick the wrong one."""
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class BackgroundCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine with the writes moved to a background thread.

        One tag is written at a time and at most one more waits (host memory: two copies of the
        rank's state at most); a save that finds both slots busy waits for the writer and the
        ``checkpoint_start`` event records how long.
        """

        def __init__(self, rank: int, world_size: int, keep: int, on_event: Callable | None):
            super().__init__(None)
            self.name = "HotspareBackgroundCheckpointEngine"
            self.rank, self.world_size, self.keep = rank, world_size, keep
            self.on_event = on_event or (lambda *a, **k: None)
            self._files: list[tuple[object, str]] = []
            self._cond = threading.Condition()
            self._queue: list = []
            self._busy = False
            self._closed = False
            self.error: BaseException | None = None
            self.last_wait_s = 0.0
            self._thread = threading.Thread(target=self._run, name="hotspare-checkpoint", daemon=True)
            self._thread.start()

        # ---- DeepSpeed's CheckpointEngine interface (called by save_checkpoint) ----------------

        def create(self, info) -> None:
            self._files = []

        def save(self, state_dict, path: str) -> None:
            # The copy is what the step pays; the live tensors change at the next step.
            self._files.append((clone_tensors_for_torch_save(state_dict), path))

        def preserves_storage_sharing(self) -> bool:
            return False  # save() clones everything itself; DeepSpeed need not clone first

        def commit(self, info) -> bool:
            self._raise_if_failed()
            files, self._files = self._files, []
            t0 = time.monotonic()
            with self._cond:
                while len(self._queue) >= 1 and not self._closed:
                    self._cond.wait(1.0)  # one tag queued behind the one being written: wait
                if self._closed:
                    raise checkpoint.CheckpointWriteError("the checkpoint writer is closed")
                self._queue.append((info.save_dir, info.tag, files))
                self._cond.notify_all()
            self.last_wait_s = time.monotonic() - t0
            return True

        # ---- hotspare's side --------------------------------------------------------------------

        def flush(self, timeout_s: float) -> bool:
            """Wait until every queued tag is written; False if ``timeout_s`` passed first."""
            deadline = time.monotonic() + timeout_s
            with self._cond:
                while (self._queue or self._busy) and self.error is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 1.0))
            self._raise_if_failed()
            return True

        @property
        def writing(self) -> bool:
            """Whether the writer thread is alive (until :meth:`close` has returned)."""
            return self._thread.is_alive()

        def close(self, timeout_s: float = 600.0) -> None:
            """Write what is queued, then stop the writer thread."""
            try:
                self.flush(timeout_s)
            finally:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                self._thread.join(timeout=10.0)

        def _raise_if_failed(self) -> None:
            if self.error is not None:
                raise checkpoint.CheckpointWriteError(f"writing a persistent checkpoint failed: {self.error}; the files of "
                                           f"that tag are incomplete and it will not be loaded") from self.error

        def _run(self) -> None:
            while True:
                with self._cond:
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    if not self._queue:
                        return
                    save_dir, tag, files = self._queue.pop(0)
                    self._busy = True
                    self._cond.notify_all()
                try:
                    self._write(save_dir, tag, files)
                except BaseException as exc:  # noqa: BLE001 - reported at the next save or flush
                    self.error = exc
                    self.on_event("checkpoint_failed", error=f"{type(exc).__name__}: {exc}", tag=tag)
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()

        def _write(self, save_dir: str, tag: str, files: list) -> None:
            t0 = time.monotonic()
            nbytes = 0
            for state, path in files:
                tmp = f"{path}.tmp{os.getpid()}"
                torch.save(state, tmp, _use_new_zipfile_serialization=self.zipfile_serialization)
                os.replace(tmp, path)  # a crash mid-write leaves no file under the real name
                nbytes += os.path.getsize(path)
            checkpoint.write_marker(save_dir, tag, self.rank, self.world_size, [os.path.basename(p) for _, p in files], nbytes)
            m = checkpoint.TAG.match(tag)
            self.on_event("checkpoint_saved", version=int(m.group(1)) if m else None, tag=tag, bytes=nbytes,
                          seconds=time.monotonic() - t0)
            # Every rank prunes after its marker: the last one to finish a tag sees it complete.
            checkpoint.prune(save_dir, self.world_size, self.keep)

    return BackgroundCheckpointEngine
