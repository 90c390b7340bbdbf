"""hotspare's exception hierarchy (hotspare.errors): every exception the library defines derives
from HotspareError, and whether a survivor recovers from an error is decided by its type
(hotspare's own, then torch's), by gloo's and NCCL's text only for a plain RuntimeError."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch.distributed as dist

import hotspare
from hotspare.errors import FatalError, HotspareError, RecoverableError
from hotspare.recovery import is_distributed_error


def library_exceptions() -> dict[str, type]:
    """Every exception class defined in hotspare's modules (integrations and testing aside: they
    import the host frameworks)."""
    out = {}
    for info in pkgutil.walk_packages(hotspare.__path__, "hotspare."):
        if ".integrations" in info.name or ".testing" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                out[f"{info.name}.{name}"] = obj
    return out


def test_every_exception_hotspare_defines_derives_from_its_base():
    found = library_exceptions()
    assert len(found) >= 15, sorted(found)
    assert [name for name, cls in found.items() if not issubclass(cls, HotspareError)] == []
    assert not [name for name, cls in found.items() if issubclass(cls, RecoverableError) and issubclass(cls, FatalError)]


@pytest.mark.parametrize("exc, recoverable", [
    (RecoverableError("a peer left"), True),
    (dist.DistNetworkError("reset"), True),
    (TimeoutError("collective"), True),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4000"), True),
    (FatalError("state lost; timed out waiting for a copy"), False),  # the type wins over the text
    (RuntimeError("shape mismatch in the step"), False),
    (ValueError("a bug"), False),
])
def test_recoverability_is_decided_by_type_then_by_text(exc, recoverable):
    assert is_distributed_error(exc) is recoverable
