"""Where a landing rank's state comes from: its own snapshot (a survivor), its node keeper's
retained copy (a spare on the dead rank's node), its bytes from the holders of its mirror or
the decoded shares of its stripe (any spare), or, when some rank's every in-memory copy is gone,
the newest complete persistent checkpoint.

A spare's keeper copy is taken over before the ranks exchange what they hold
(:func:`take_over_retained`), read by the restore, then carried on as the spare's own
snapshot buffers (:func:`inherit_kept`) or dropped (:func:`drop_kept`).
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from .. import checkpoint
from ..events import log
from ..keeper import KeeperError
from ..slots import NO_VERSION, Inherited
from ..planning import KEEPER, STRIPE, NoConsistentVersion
from ..recovery import RecoveryError
from ..retain import RetainedSnapshots


def take_over_retained(session, rank: int) -> dict[int, int]:
    """A spare: what this node's keeper retained of ``rank``, checked chunk by chunk
    ({version: slot}; empty when nothing usable, e.g. the rank died on another node)."""
    drop_kept(session)
    if session.keeper is None:
        return {}
    try:
        kept, detail = session.keeper.take_over(rank, session.state.layout_for)
    except KeeperError as exc:
        log(f"rank {rank}: {exc}; restoring from peers")
        return {}
    session.events("keeper_attach", **detail)
    if detail.get("corrupt_chunks"):
        log(f"rank {rank}: the keeper's copy of version(s) {', '.join(detail['corrupt_chunks'])} fails its "
            f"checksum (chunks {detail['corrupt_chunks']}); it is not used")
    if detail.get("device", {}).get("why"):
        log(f"rank {rank}: the keeper's device copy (version {detail['device']['version']}) is not used: "
            f"{detail['device']['why']}")
    session.kept = kept
    return kept.good if kept is not None else {}


def inherit_kept(session, version: int) -> Inherited | None:
    """A spare: the dead rank's retained segment becomes its own snapshots (the keeper would
    hand it the same one), still holding each verified version up to ``version`` (the one
    landed on: the state was restored from it, or from a peer's copy of it)."""
    if session.kept is None:
        return None
    kept, session.kept = session.kept, None
    segment, good = kept.segment, kept.good
    layout = session.state.layout_for(segment.layout_id)
    snapshots = RetainedSnapshots(segment, layout, session.pin_memory, kept.device)
    by_slot = {slot: v for v, slot in good.items() if v <= version}
    versions = [by_slot.get(slot, NO_VERSION) for slot in range(len(snapshots.buffers))]
    for slot, v in enumerate(versions):
        if v == NO_VERSION:
            snapshots.begin(slot)
    return Inherited(layout, snapshots, versions)


def drop_kept(session) -> None:
    """Close a taken-over keeper copy that is not carried on."""
    if session.kept is not None:
        session.kept.segment.close()
        session.kept = None


def restore_from_memory(session, target, pending, retained) -> tuple[int, dict]:
    """Land on ``target``: this rank's own snapshot, its node keeper's copy, or its bytes from the
    holders of its mirror (``pending``: the transfer started before the host's groups were built)."""
    rank = session.generation.rank
    received, moved = pending.wait()
    first = target.sources[rank][0]
    on_device = None
    if first == KEEPER:
        kept = session.kept
        buf, layout, source = (kept.segment.slots[kept.good[target.version]],
                               session.state.layout_for(kept.segment.layout_id), "keeper")
        if kept.device_version == target.version:
            # The tensors from the keeper's device copy (device to device); the metadata and
            # RNG states from the host slot of the same version.
            on_device, source = kept.device, "keeper_device"
    elif received is not None:
        (buf, layout), source = received, "stripe" if first == STRIPE else "peers"
    else:
        buf = retained.own_snapshot(target.version) if retained is not None else None
        layout, source = (retained.layout if retained is not None else None), "self"
        if buf is None:
            raise RecoveryError(f"rank {rank} has no snapshot of version {target.version} to restore")
    t0 = time.monotonic()
    session.state.restore(buf, layout, tensors_from=on_device)
    t1 = time.monotonic()
    session.state.resync()
    return target.version, {"source": source, **moved, "load_s": t1 - t0, "resync_s": time.monotonic() - t1}


def fall_back(session, lost: NoConsistentVersion, control_group) -> tuple[int, dict]:
    """Every in-memory copy of some rank is gone: load the newest complete persistent checkpoint
    (every rank the same one), or stop every rank saying what was lost."""
    ck, world = session.config.checkpoint, session.generation.world_size
    steps = checkpoint.complete_steps(ck.dir, world) if ck.enabled else []
    # Every writer drained before the scan (recover flushes), so all ranks see the same
    # directory; the minimum guards against one that did not.
    newest = torch.tensor([steps[-1] if steps else -1], dtype=torch.int64)
    dist.all_reduce(newest, op=dist.ReduceOp.MIN, group=control_group)
    step = int(newest)
    if step < 0:
        where = (f"no complete checkpoint exists under {ck.dir}" if ck.enabled else
                 "no persistent checkpoint is configured (hotspare.checkpoint)")
        session.events("fallback", reason=str(lost), checkpoint=None)
        message = (f"{lost}. {where.capitalize()} to fall back on; every rank stops. Add mirror replicas "
                   f"(hotspare.mirror.replicas) or persistent checkpoints (hotspare.checkpoint.every) to "
                   f"survive this failure.")
        session.control.abort(message)  # every launcher stops its workers: no cascade of spares
        raise RecoveryError(message) from None
    path = os.path.join(ck.dir, checkpoint.tag_of(step))
    session.events("fallback", version=step, reason=str(lost), checkpoint=path)
    log(f"rank {session.generation.rank}: {lost}; falling back on the persistent checkpoint {path}: the steps "
        f"since step {step} are run again")
    session.state.load_checkpoint(ck.dir, checkpoint.tag_of(step))
    return step, {"source": "checkpoint", "checkpoint": path}
