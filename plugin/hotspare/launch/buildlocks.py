"""torch's extension builds (DeepSpeed's ops) and the locks a killed build leaves."""
from __future__ import annotations

import os
import sys
import time

from .processes import log


STALE_LOCK_S = 600.0


def extensions_root(environ) -> str:
    """Where torch builds extensions for this interpreter (torch 2.13's
    ``cpp_extension._get_build_directory`` without its side effect of creating the directory;
    tests/test_launch.py pins the two together)."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return environ["TORCH_EXTENSIONS_DIR"]
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    folder = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accelerator}"
    return os.path.join(get_default_build_root(), folder)


def warn_stale_build_locks(root: str | None = None, now: float | None = None) -> list[str]:
    """torch's extension builds (DeepSpeed's ops) serialise on a ``lock`` file in each build
    directory, and a build killed midway leaves it: every later process that needs that op
    then waits for it silently, forever. A lock older than :data:`STALE_LOCK_S` is named with
    what to do (it cannot be told from a build still running elsewhere, so it is not removed).
    Returns the locks named."""
    root = extensions_root(os.environ) if root is None else root
    now = time.time() if now is None else now
    stale = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        lock = os.path.join(root, name, "lock")
        try:
            age = now - os.stat(lock).st_mtime
        except OSError:
            continue
        if age > STALE_LOCK_S:
            stale.append(lock)
            log(f"warning: {lock} is {age / 60:.0f} min old: a build of the {name!r} op was killed midway, and any "
                 f"worker that needs that op will wait for it forever. If no build is running, remove it: rm {lock}")
    return stale
