"""Rebuilding process groups in place: every handle a host framework holds is re-pointed.

After a failure the old generation's groups are dead (gloo has no abort; a destroyed group
cannot be revived), but DeepSpeed and its optimizer keep references to them in attributes,
lists, dicts and on parameters (ZeRO-3's ``param.ds_process_group``). Instead of
re-initialising the engine (which re-partitions, re-allocates and is reported to grow host
memory, DeepSpeed issue 7204), hotspare:

1. walks the host's objects in a fixed order and records every distinct ProcessGroup it finds
   with its global ranks (:func:`find_groups`), before the old groups are destroyed;
2. joins the new generation's default group;
3. creates one new group per old one, in the recorded order (every rank walks the same
   structure, so every rank creates the same groups in the same order; a signature check
   across ranks turns any disagreement into a clear error instead of a hang);
4. replaces each old reference by its new group: through the references the walk of step 1
   recorded (:func:`repoint_records`; nothing runs host code in between, so they still hold the
   old groups, and the recovery walks the host once, not twice), or by walking again
   (:func:`repoint`).

The walk is bounded: it enters objects of the named host packages, containers, modules,
parameters' attribute dicts and the closures of the host packages' own functions (ZeRO-3 hangs
functions on each parameter whose closure holds its ``Init``, and that holds a group), never
tensor storage or foreign libraries.
"""
from __future__ import annotations

import datetime
import hashlib
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

HOST_PACKAGES = ("deepspeed", "hotspare", "megatron")
CLOSURE_PACKAGES = ("deepspeed", "megatron")
"""Whose functions' closures the walk enters (not hotspare's: its wrappers close over the
session, whose own groups are not the host's)."""
MAX_DEPTH = 16
_MODULE_DICTS = frozenset({"_modules", "_parameters", "_buffers"})


# Values the walk never looks into, by exact type: most of what it meets (checked first, as
# ``isinstance(x, ProcessGroup)`` goes through a Python-level metaclass check in torch 2.13).
_LEAVES = frozenset({int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
                     types.MethodType, types.BuiltinFunctionType, type})
_GROUP_TYPES: dict[type, bool] = {}


def _is_group(obj) -> bool:
    t = type(obj)
    known = _GROUP_TYPES.get(t)
    if known is None:
        known = _GROUP_TYPES[t] = isinstance(obj, dist.ProcessGroup)
    return known


def _of(module_name: str | None, packages: tuple[str, ...]) -> bool:
    """``module_name`` is one of ``packages`` or inside one (not a user module that merely starts
    with the same letters: ``megatron_pp``, whose wrappers may close over hotspare's session)."""
    return (module_name or "").split(".", 1)[0] in packages


def _enter(obj) -> bool:
    """Whether the walk looks inside ``obj``."""
    t = type(obj)
    if t in _LEAVES:
        return False
    if t is types.FunctionType:
        return obj.__closure__ is not None and _of(obj.__module__, CLOSURE_PACKAGES)
    if t in (list, tuple, dict, set, frozenset) or isinstance(obj, (list, tuple, dict, set, frozenset)):
        return True
    if isinstance(obj, torch.Tensor):
        return bool(getattr(obj, "__dict__", None))  # ZeRO-3 keeps its ds_* attributes here
    if isinstance(obj, torch.nn.Module):
        return True
    if isinstance(obj, types.ModuleType):
        return _of(obj.__name__, HOST_PACKAGES)
    mod = t.__module__ or ""
    return _of(mod, HOST_PACKAGES) and hasattr(obj, "__dict__")


def _children(obj):
    """(setter, child) pairs of ``obj``; setter(new) replaces that reference."""
    if isinstance(obj, dict):
        for k in list(obj):
            yield (lambda new, k=k: obj.__setitem__(k, new)), obj[k]
    elif isinstance(obj, list):
        for i in range(len(obj)):
            yield (lambda new, i=i: obj.__setitem__(i, new)), obj[i]
    elif isinstance(obj, (tuple, set, frozenset)):
        for v in list(obj):
            yield None, v  # immutable: no setter (repoint refuses a group held here)
    elif type(obj) is types.FunctionType:
        for cell in obj.__closure__:
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet filled
                continue
            yield (lambda new, cell=cell: setattr(cell, "cell_contents", new)), value
    else:
        d = vars(obj)
        for k in sorted(d):
            if k in _MODULE_DICTS and isinstance(obj, torch.nn.Module):
                # A module's submodules, parameters and buffers are its own children: one level
                # of nesting is one step of depth (megatron-core's layers hold their tensor-
                # parallel group 7 modules down).
                inner = d[k]
                for j in list(inner):
                    yield (lambda new, inner=inner, j=j: inner.__setitem__(j, new)), inner[j]
            else:
                yield (lambda new, k=k: setattr(obj, k, new)), d[k]


def _walk(roots: Iterable, visit) -> None:
    """Depth-first over ``roots`` in order; ``visit(group, setter, parent)`` for each group reference.

    An object met again at a smaller depth than its first visit is entered again (only to go
    deeper: its own group references were visited the first time), so that what lies under it
    is not cut off by the depth of the longer path that reached it first.

    Closures are entered once per code object (again only at a smaller depth): ZeRO 3 hangs a
    dozen on each parameter, every one closing over that parameter (reached anyway) and the same
    ``Init``. Entering each of them, again at each shorter path, more than doubled the walk
    (31 -> 68 ms for 149 parameters; 45 ms entering each once). The cost: a group that only some
    instances of one closure capture would be missed (none in DeepSpeed 0.19 or megatron-core
    0.16; the recovery tests' tripwire looks for any)."""
    seen: dict[int, int] = {}  # id -> the smallest depth it was entered at
    codes: dict[int, int] = {}  # code object of a closure -> the smallest depth one was entered at

    def go(obj, depth):
        if depth > MAX_DEPTH:
            return
        if type(obj) is types.FunctionType:
            if codes.get(id(obj.__code__), MAX_DEPTH + 1) <= depth:
                return
            codes[id(obj.__code__)] = depth
        first = seen.get(id(obj))
        if first is not None and first <= depth:
            return
        seen[id(obj)] = depth
        for setter, child in _children(obj):
            if type(child) in _LEAVES:
                continue
            if _is_group(child):
                if first is None:
                    visit(child, setter, obj)
            elif _enter(child):
                go(child, depth + 1)

    for root in roots:
        if _enter(root):
            go(root, 0)


@dataclass
class GroupRecord:
    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    backend: str
    was_default: bool
    """It was the default group (its replacement is the new default group, not a new_group)."""
    refs: list[Callable | None] = field(default_factory=list, repr=False, compare=False)
    """A setter for each reference to ``group`` the walk found (None: held where it cannot be
    replaced); :func:`repoint_records` calls them."""


def find_groups(roots: Iterable) -> list[GroupRecord]:
    """Every distinct ProcessGroup reachable from ``roots``, in walk order, with its global ranks
    and every reference to it.

    Call while the groups are still registered (before ``destroy_process_group``).
    """
    out: dict[int, GroupRecord] = {}
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None

    def visit(group, setter, _parent):
        rec = out.get(id(group))
        if rec is None:
            try:
                ranks = tuple(dist.get_process_group_ranks(group))
                backend = str(dist.get_backend(group))
            except (ValueError, RuntimeError) as exc:
                raise RuntimeError(f"a process group held by the host is not registered with torch.distributed "
                                   f"({exc}); it cannot be rebuilt") from None
            rec = out[id(group)] = GroupRecord(group, ranks, backend, group is default)
        rec.refs.append(setter)

    _walk(roots, visit)
    return list(out.values())


def repoint_records(records: list[GroupRecord], mapping: dict[int, dist.ProcessGroup]) -> int:
    """Replace every reference :func:`find_groups` recorded by its group's new one; returns how
    many were replaced. Valid while the host has not run since the walk (a recovery: the walk,
    then leaving and joining a generation, then this), without walking again."""
    count = 0
    for rec in records:
        for setter in rec.refs:
            if setter is None:
                raise RuntimeError(f"a process group is held inside an immutable container; hotspare cannot "
                                   f"re-point it in place (ranks {list(rec.ranks)})")
            setter(mapping[id(rec.group)])
            count += 1
    return count


def signature(records: list[GroupRecord], world_size: int) -> str:
    """What every rank must agree on before creating groups: the rank sets, in order.

    The default group's size is normalised (a full-world group records as 'world'), so
    different generations of the same world agree.
    """
    parts = ["world" if len(r.ranks) == world_size and r.ranks == tuple(range(world_size)) else
             ",".join(map(str, r.ranks)) for r in records]
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:16] + f"/{len(parts)}"


def collective_device() -> torch.device:
    """Where a tensor for a collective on the default group must live: NCCL takes only device
    tensors (its process group has no CPU backend), gloo host ones ("cpu:gloo,cuda:nccl" has
    both: the host)."""
    backend = str(dist.get_backend())
    if "nccl" in backend and "cpu" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _digests(text: str) -> list[int]:
    """Every rank's 60-bit digest of ``text``, by rank (one int64 all-gather on the default group)."""
    local = torch.tensor([int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)], dtype=torch.int64,
                         device=collective_device())
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [int(t.item()) for t in gathered]


def check_signature(records: list[GroupRecord], world_size: int) -> None:
    """All-gather the signature over the (new) default group; raise if any rank differs."""
    # One int64 all-gather: all_gather_object pickles and takes two.
    everyone = [f"{d:015x}" for d in _digests(signature(records, world_size))]
    if len(set(everyone)) != 1:
        raise RuntimeError(
            f"ranks disagree on the process groups to rebuild (signatures by rank: {everyone}); a spare's "
            f"engine must have the same group structure as the survivors'. Are all ranks running the same "
            f"script and config?")


def check_same(text: str, what: str) -> None:
    """Raise on every rank unless every rank passes the same ``text`` (collective)."""
    everyone = _digests(text)
    if len(set(everyone)) != 1:
        odd = [r for r, d in enumerate(everyone) if d != everyone[0]]
        raise RuntimeError(f"ranks disagree on {what}: rank 0 has {text!r:.200} and ranks {odd} differ from it (as "
                           f"digests: {[f'{d:015x}' for d in everyone]}). Are all ranks running the same script and "
                           f"config?")


def create_groups(records: list[GroupRecord], timeout_s: float, backend: str | None = None) -> dict[int, dist.ProcessGroup]:
    """New groups for the current default group, one per record, in order: {id(old): new}.

    A record spanning the whole world with the default group's object becomes the new default
    group itself; every other record gets a ``new_group`` with the same ranks.
    """
    default = dist.distributed_c10d._get_default_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    mapping: dict[int, dist.ProcessGroup] = {}
    for rec in records:
        if rec.was_default:
            mapping[id(rec.group)] = default
            continue
        mapping[id(rec.group)] = dist.new_group(list(rec.ranks), timeout=timeout,
                                                backend=backend or rec.backend)
    return mapping


def repoint(roots: Iterable, mapping: dict[int, dist.ProcessGroup]) -> int:
    """Replace every reference to an old group by its new one; returns how many were replaced.

    A group reached that is not in ``mapping`` is an error (it would be a dead handle after the
    rebuild), and so is one inside a tuple or set, which cannot be replaced in place (DeepSpeed
    0.19 holds none; tests/test_rebuild.py would show a new one).
    """
    count = 0

    def visit(group, setter, parent):
        nonlocal count
        if id(group) not in mapping:
            if any(group is g for g in mapping.values()):
                return  # already new (reached twice through different paths)
            raise RuntimeError("found a process group that was not recorded before the rebuild; it would stay "
                               "dead. Record groups with find_groups() on the same roots.")
        if setter is None:
            raise RuntimeError(f"a process group is held inside an immutable {type(parent).__name__}; hotspare "
                               f"cannot re-point it in place")
        setter(mapping[id(group)])
        count += 1

    _walk(roots, visit)
    return count
