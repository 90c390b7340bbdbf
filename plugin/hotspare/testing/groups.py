"""A tripwire for the rebuild: process groups torch no longer has that live objects still hold.

After a recovery every handle a host framework holds must point at the new generation's groups.
A destroyed gloo group keeps working while its old peers live, and a group that is only asked
its size never fails at all, so a handle the rebuild missed can go unnoticed until a collective
runs on it. This finds them through every live object's attributes (the garbage collector's
list of objects), independently of the walk in :mod:`hotspare.rebuild`."""
from __future__ import annotations

import gc
import types

from torch.distributed import distributed_c10d as c10d

from hotspare.rebuild import _is_group


def _items(container) -> list:
    try:
        if isinstance(container, dict):
            return list(dict.items(container))
        if isinstance(container, list):
            return list(enumerate(list.copy(container)))
    except RuntimeError:  # changed size meanwhile (another thread)
        pass
    return []


def dead_groups_held(skip_modules: tuple[str, ...] = ("hotspare.",)) -> list[str]:
    """'<owner>.<attribute>[<key>]' for each reference to a process group that is not registered
    with torch.distributed (destroyed, or left with an old generation) held by a live object:
    as an attribute, or in a list or dict that is one. The owner is named by its type
    ('module.Type') or, for a Python module, by its name; owners from ``skip_modules`` are
    skipped (hotspare keeps left groups until they are reaped).

    Every object with an attribute dict is looked at, through that dict: a dict that holds only
    groups and plain values is not tracked by the garbage collector, so searching its tracked
    containers would miss it."""
    gc.collect()  # garbage is not held
    live = {id(g) for g in c10d._world.pg_map}
    found = set()
    for obj in gc.get_objects():
        try:
            attrs = object.__getattribute__(obj, "__dict__")
        except Exception:  # noqa: BLE001 - no __dict__, or one that raises (pydantic's classes)
            continue
        if not isinstance(attrs, dict):
            continue  # a class's mappingproxy
        where = obj.__name__ if isinstance(obj, types.ModuleType) else \
            f"{type(obj).__module__}.{type(obj).__qualname__}"
        if where.startswith(skip_modules):
            continue
        for attr, value in _items(attrs):
            if _is_group(value):
                if id(value) not in live:
                    found.add(f"{where}.{attr}")
            elif isinstance(value, (list, dict)):
                found.update(f"{where}.{attr}[{key}]" for key, item in _items(value)
                             if _is_group(item) and id(item) not in live)
    return sorted(found)
