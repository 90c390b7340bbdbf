"""Persistent checkpoints: the last tier.

They are read only when every in-memory copy of some rank's state is lost (a rank and all the
holders of its mirror died together). Both hosts share the directory scheme below (a
``global_step<N>`` directory per tag, a completion marker per rank); on megatron-core the files
are ``dist_checkpointing``'s (:meth:`hotspare.integrations.megatron.MegatronSession.save_checkpoint`).

On DeepSpeed they are written off the critical path. ``engine.save_checkpoint`` stays DeepSpeed's: the files
and their layout are DeepSpeed's own (``<dir>/<tag>/mp_rank_00_model_states.pt``,
``zero_pp_rank_<R>_mp_rank_00_optim_states.pt``, ...), and ``engine.load_checkpoint(dir, tag)``
reads them. What hotspare changes is the checkpoint engine DeepSpeed writes through
(:class:`BackgroundCheckpointEngine`): ``save`` takes a host copy of each state dict (the only
part on the step's path) and a writer thread does the ``torch.save``.

When all of one rank's files of a tag are on disk, that rank writes the marker
``<tag>/hotspare.rank<R>.done``; a tag is complete when every rank's marker is there
(:func:`complete_steps`). DeepSpeed's ``latest`` file is not written: with the files still in
flight it would name a tag that may never be complete.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable

import torch

from .errors import FatalError

TAG_PREFIX = "global_step"
_TAG = re.compile(rf"^{TAG_PREFIX}(\d+)$")
_MARKER = "hotspare.rank{rank}.done"


def tag_of(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def complete_steps(directory: str, world_size: int) -> list[int]:
    """Steps (ascending) whose checkpoint under ``directory`` has every rank's completion marker."""
    if not directory or not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        m = _TAG.match(name)
        if not m:
            continue
        tag_dir = os.path.join(directory, name)
        markers = [_read_marker(os.path.join(tag_dir, _MARKER.format(rank=r))) for r in range(world_size)]
        if all(mk is not None and mk.get("world_size") == world_size for mk in markers):
            steps.append(int(m.group(1)))
    return sorted(steps)


def write_marker(directory: str, tag: str, rank: int, world_size: int, files: list[str], nbytes: int) -> None:
    """Say that ``rank``'s part of ``tag`` is on disk (call after its last file is; the marker
    itself is replaced atomically, so a crash leaves it whole or absent). ``files`` and
    ``nbytes``: what the caller wrote itself (on megatron-core, the extras file beside
    ``dist_checkpointing``'s own)."""
    marker = os.path.join(directory, tag, _MARKER.format(rank=rank))
    with open(marker + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"world_size": world_size, "files": files, "bytes": nbytes}, f)
    os.replace(marker + ".tmp", marker)


def rank_done(directory: str, tag: str, rank: int, world_size: int) -> bool:
    """Whether ``rank``'s marker for ``tag`` is there (one file read: every rank checks its own
    and the ranks agree, instead of each reading every rank's)."""
    mk = _read_marker(os.path.join(directory, tag, _MARKER.format(rank=rank)))
    return mk is not None and mk.get("world_size") == world_size


def _read_marker(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # absent, or torn by a crash mid-write: not complete


class CheckpointWriteError(FatalError):
    """The background writer failed; the message names the file and the cause."""


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
                    raise CheckpointWriteError("the checkpoint writer is closed")
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
                raise CheckpointWriteError(f"writing a persistent checkpoint failed: {self.error}; the files of "
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
            write_marker(save_dir, tag, self.rank, self.world_size, [os.path.basename(p) for _, p in files], nbytes)
            m = _TAG.match(tag)
            self.on_event("checkpoint_saved", version=int(m.group(1)) if m else None, tag=tag, bytes=nbytes,
                          seconds=time.monotonic() - t0)
            # Every rank prunes after its marker: the last one to finish a tag sees it complete.
            prune(save_dir, self.world_size, self.keep)

    return BackgroundCheckpointEngine


def prune(directory: str, world_size: int, keep: int) -> list[str]:
    """Delete every tag older than the ``keep`` newest complete ones; returns what was deleted.

    Ranks write their tags in order, so once a tag is complete no rank is still writing an
    older one: an incomplete older tag is what a crash mid-save left, never a save in flight.
    """
    complete = complete_steps(directory, world_size)
    if len(complete) <= keep:
        return []
    cutoff = complete[-keep]
    deleted = []
    for name in os.listdir(directory):
        m = _TAG.match(name)
        if m and int(m.group(1)) < cutoff:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            deleted.append(name)
    return sorted(deleted)
