"""Persistent checkpoints: the last tier.

They are read only when every in-memory copy of some rank's state is lost (a rank and all the
holders of its mirror died together). Both hosts share the directory scheme below (a
``global_step<N>`` directory per tag, a completion marker per rank); on megatron-core the files
are ``dist_checkpointing``'s (:meth:`hotspare.integrations.megatron.MegatronSession.save_checkpoint`).

On DeepSpeed they are written off the critical path, by DeepSpeed's own ``save_checkpoint`` through
a background-writing checkpoint engine (:mod:`hotspare.integrations.deepspeed.checkpoint_engine`).

When all of one rank's files of a tag are on disk, that rank writes the marker
``<tag>/hotspare.rank<R>.done``; a tag is complete when every rank's marker is there
(:func:`complete_steps`). DeepSpeed's ``latest`` file is not written: with the files still in
flight it would name a tag that may never be complete.
"""
from __future__ import annotations

import json
import os
import re
import shutil

from .errors import FatalError

TAG_PREFIX = "global_step"
TAG = re.compile(rf"^{TAG_PREFIX}(\d+)$")
_MARKER = "hotspare.rank{rank}.done"


def tag_of(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def complete_steps(directory: str, world_size: int) -> list[int]:
    """Steps (ascending) whose checkpoint under ``directory`` has every rank's completion marker."""
    if not directory or not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        m = TAG.match(name)
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
        m = TAG.match(name)
        if m and int(m.group(1)) < cutoff:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            deleted.append(name)
    return sorted(deleted)
