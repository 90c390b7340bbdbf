"""A trainer's side of its node's keeper (:mod:`hotspare.keeper`): the requests over the keeper's
Unix socket, the rank's retained snapshots (its mirror's own slots live in the keeper's segment),
and a spare's take-over of a dead rank's segment, checked (host slots by their checksums, the
device copy by its device sum)."""
from __future__ import annotations

import json
import socket
from dataclasses import dataclass

from .keeper import KeeperError, read_line
from .retain import RetainedSegment, SegmentError


class KeeperClient:
    """A trainer's handle on its node's keeper."""

    def __init__(self, sock_path: str, timeout_s: float = 10.0, device_tier: bool = False):
        self.sock_path, self.timeout_s, self.device_tier = sock_path, timeout_s, device_tier

    def device_index(self) -> int | None:
        """This process's GPU, where the keeper keeps its device copy (None: no device tier)."""
        if not self.device_tier:
            return None
        import torch

        return torch.cuda.current_device()

    def request(self, op: str, **fields) -> dict:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            s.connect(self.sock_path)
            s.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
            reply = json.loads(read_line(s) or b"{}")
        except (OSError, ValueError) as exc:
            raise KeeperError(f"the node's keeper at {self.sock_path} did not answer {op!r} ({exc}); is hotspare-run "
                              f"still running on this node?") from None
        finally:
            s.close()
        if not reply.get("ok"):
            raise KeeperError(reply.get("error") or f"the keeper refused {op!r}")
        return reply

    def open(self, rank: int, layout_id: int, nbytes: int, chunk_bytes: int, budget_bytes: int = 0,
             device: int | None = None) -> tuple[RetainedSegment | None, str, object]:
        """Rank ``rank``'s segment for this layout (made now, or the one kept: same layout), mapped;
        None when the budget leaves it out. Also returns the keeper's note on what it gave up, and,
        with ``device`` (a GPU index: ``retain.device_tier``), the keeper's buffer on that GPU,
        mapped (None when the keeper could not make one: the note says why)."""
        reply = self.request("open", rank=rank, layout_id=layout_id, nbytes=nbytes, chunk_bytes=chunk_bytes,
                             budget_bytes=budget_bytes, device=device)
        held = reply["held"]
        note = " ".join(filter(None, (reply.get("note", ""), reply.get("device_note", ""))))
        buf = None
        if reply.get("device") is not None:
            from .devicemem import attach

            buf = attach(reply["device"])
        return (RetainedSegment.attach(held["path"]) if held else None), note, buf

    def lookup(self, rank: int) -> tuple[RetainedSegment | None, dict | None]:
        """The segment this keeper holds for ``rank`` (a dead rank's, for the spare that takes it),
        and the IPC handle of its device copy (None: no device tier)."""
        reply = self.request("lookup", rank=rank)
        held = reply["held"]
        if held is None:
            return None, None
        try:
            return RetainedSegment.attach(held["path"]), reply.get("device")
        except SegmentError:
            return None, None

    def stats(self) -> dict:
        return self.request("stats")

    # ---- what a trainer does with it --------------------------------------------------------------

    def snapshots_for(self, rank: int, chunk_bytes: int, budget_bytes: int, note, pin_memory: bool = False,
                      device: int | None = None):
        """A mirror's ``snapshots`` provider: rank ``rank``'s own snapshots in this keeper's segment
        (private memory when the budget leaves the rank out; ``note(text)`` hears what was given up).
        ``pin_memory``: page-lock them (an accelerator is in use); ``device``: this rank's GPU index,
        where the keeper keeps a copy too (``retain.device_tier``)."""
        from .slots import PrivateSnapshots
        from .retain import RetainedSnapshots

        def make(layout):
            try:
                segment, given_up, device_buf = self.open(rank, layout.id, layout.nbytes, chunk_bytes,
                                                          budget_bytes, device)
            except KeeperError as exc:  # the keeper died (its launcher said so): train on, without it
                note(f"{exc}; this rank's snapshots stay in its own memory (a spare gets its state from the "
                     f"peers' mirrors)")
                return PrivateSnapshots(layout, pin_memory)
            if given_up:
                note(given_up)
            if segment is None:
                return PrivateSnapshots(layout, pin_memory)
            return RetainedSnapshots(segment, layout, pin_memory, device_buf)

        return make

    def take_over(self, rank: int, layout_for) -> tuple["Kept | None", dict]:
        """What this node's keeper retained of ``rank`` (a dead rank whose place this spare takes),
        and details for the event log. ``layout_for(layout_id)`` is this engine's layout with that
        id, or None: a segment of another layout is not used."""
        segment, device_wire = self.lookup(rank)
        if segment is None:
            return None, {"retained": False}
        layout = layout_for(segment.layout_id)
        if layout is None:
            detail = {"retained": True, "layout_mismatch": f"{segment.layout_id:x}"}
            segment.close()
            return None, detail
        complete = segment.complete_versions()
        corrupt = {v: segment.verify(s) for v, s in complete.items()}
        good = {v: s for v, s in complete.items() if not corrupt[v]}
        pending = {str(v): len(segment.unverified(s)) for v, s in good.items()}
        detail = {"retained": True, "complete": sorted(complete), "verified": sorted(good),
                  "corrupt_chunks": {str(v): c for v, c in corrupt.items() if c},
                  "unverified_chunks": {v: n for v, n in pending.items() if n}}
        kept = Kept(segment, good)
        if device_wire is not None:
            from .devicemem import attach

            try:
                kept.device = attach(device_wire)
            except Exception as exc:  # noqa: BLE001 - a handle this process cannot open: the host tier serves
                detail["device"] = {"version": segment.device_record()[0], "usable": False,
                                    "why": f"cannot map it: {exc}"}
            else:
                kept.device_version, detail["device"] = check_device(segment, layout, kept.device, good)
        return kept, detail


@dataclass
class Kept:
    """A dead rank's state as its node's keeper retained it, taken over by a spare."""

    segment: RetainedSegment
    good: dict[int, int]
    """{version: slot} of the complete versions whose every chunk passes its checksum or was sealed
    by a writer that died before checksumming it (``unverified_chunks``; see :mod:`hotspare.retain`)."""
    device: object = None
    """The keeper's device copy, mapped (``retain.device_tier``), or None."""
    device_version: int = -1
    """The version the device copy holds, checked; -1: none usable."""


def check_device(segment: RetainedSegment, layout, buf, good: dict[int, int]) -> tuple[int, dict]:
    """The version a dead rank's device copy ``buf`` can be restored from (-1: none), and why: the
    version its record names, when that version is also complete and good in the host slots
    (``good``, whose metadata the restore reads) and the copy's device sum matches the record."""
    from .devicemem import device_sum

    version, total = segment.device_record()
    if version == -1:
        return -1, {"version": version, "usable": False, "why": "it holds no sealed version"}
    if version not in good:
        return -1, {"version": version, "usable": False, "why": "no good host copy of that version beside it"}
    if int(device_sum(buf[layout.tensors_offset:])) != total:
        return -1, {"version": version, "usable": False, "why": "its device sum does not match its record"}
    return version, {"version": version, "usable": True}
