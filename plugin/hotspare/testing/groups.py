"""A tripwire for the rebuild: process groups torch no longer has that live objects still hold.

After a recovery every handle a host framework holds must point at the new generation's groups.
A destroyed gloo group keeps working while its old peers live, and a group that is only asked
its size never fails at all, so a handle the rebuild missed can go unnoticed until a collective
runs on it. This finds them from the garbage collector's view of every live dict and list
(attribute dicts included), independently of the walk in :mod:`hotspare.rebuild`."""
from __future__ import annotations

import gc

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def _attribute_dicts() -> dict[int, object]:
    """{id(obj.__dict__): obj} for every live object with an attribute dict."""
    owners = {}
    for obj in gc.get_objects():
        try:
            d = object.__getattribute__(obj, "__dict__")
        except Exception:  # noqa: BLE001 - no __dict__, or one that raises (pydantic's classes)
            continue
        if isinstance(d, dict):
            owners[id(d)] = obj
    return owners


def _dicts_by_id(owners: dict[int, object]) -> dict[int, dict]:
    return {d_id: object.__getattribute__(owner, "__dict__") for d_id, owner in owners.items()}


def _name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def dead_groups_held(skip_modules: tuple[str, ...] = ("hotspare.",)) -> list[str]:
    """'<owner type>.<attribute>[.<key>]' for each reference to a process group that is not
    registered with torch.distributed (destroyed, or left with an old generation) held in an
    object's attributes, directly or in a list or dict there, unless the object's type is from
    one of ``skip_modules`` (hotspare keeps left groups until they are reaped). Containers no
    object holds as an attribute (a frame's locals, an exception's) are not looked at."""
    gc.collect()  # garbage is not held
    live = {id(g) for g in c10d._world.pg_map}
    owners = _attribute_dicts()
    found = set()
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, list):
            items = list(enumerate(obj))
        else:
            continue
        keys = [key for key, value in items if isinstance(value, dist.ProcessGroup) and id(value) not in live]
        if not keys:
            continue
        if id(obj) in owners:  # the group is an attribute
            where = [f"{_name(owners[id(obj)])}.{key}" for key in keys]
        else:  # the group is in a list or dict that is an attribute
            where = [f"{_name(owners[d_id])}.{attr}[{key}]" for d_id, d in _dicts_by_id(owners).items()
                     for attr, value in d.items() if value is obj for key in keys]
        found.update(w for w in where if not w.startswith(skip_modules))
    return sorted(found)
