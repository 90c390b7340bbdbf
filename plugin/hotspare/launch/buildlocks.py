"""torch's extension builds (DeepSpeed's ops) and the locks a killed build leaves.

torch serialises a build on ``<build dir>/lock`` (``torch.utils.file_baton.FileBaton``): the
builder creates it with ``O_CREAT | O_EXCL`` and keeps that descriptor open until the build is
done, then closes it and removes the file; every other process waits, polling, while the file
exists. A build killed midway leaves the file, and every later process that needs that op waits
for it silently, forever. The file holds no pid, but its holder is certain: the process that has
it open. So a lock that no process has open is dead, when every process that could hold it can
be seen: the lock is this user's, on a local file system (not one other machines share), not
in a container's bind mount (another container's processes are not in this /proc), and /proc
shows every one of this user's processes' descriptors. Such a lock is removed (the op is built
again when a worker needs it); any other lock nobody here holds is named at once with what to
remove.
"""
from __future__ import annotations

import os
import sys
import time

from .processes import log

LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "ramfs",
                                "bcachefs", "jfs", "reiserfs"})
"""File systems only this machine writes (any other, e.g. nfs, lustre, gpfs, may hold a lock of a
build running on another machine)."""
RECHECK_S = 0.2
"""A lock found unheld is looked at again after this long before it is removed: its builder
closes the descriptor just before it removes the file itself."""


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


def lock_holders(info: os.stat_result) -> tuple[list[int], bool]:
    """This user's processes that have the file ``info`` open, and whether each of them could be
    looked at (False: /proc is missing, or one of them hid its descriptors)."""
    if not os.path.isdir("/proc/self/fd"):
        return [], False
    me, holders, complete = os.getuid(), [], True
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != me:
                continue
            fds = os.listdir(f"/proc/{entry.name}/fd")
        except FileNotFoundError:
            continue  # it exited meanwhile
        except PermissionError:
            complete = False
            continue
        for fd in fds:
            try:
                held = os.stat(f"/proc/{entry.name}/fd/{fd}")
            except OSError:
                continue
            if (held.st_dev, held.st_ino) == (info.st_dev, info.st_ino):
                holders.append(int(entry.name))
                break
    return holders, complete


def file_system_of(path: str) -> tuple[str, str]:
    """(mount point, file system type) of the mount that holds ``path`` ('' , '' if unknown)."""
    path, best = os.path.realpath(path), ("", "")
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount = left.split()[4].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[0]) and right:
                    best = (mount, right.split()[0])
    except OSError:
        pass
    return best


def in_container() -> bool:
    return os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv") or bool(os.environ.get("container"))


def _doubt(lock: str, info: os.stat_result) -> str:
    """Why a lock nobody here holds might still be a live build's ('' when it cannot be)."""
    mount, kind = file_system_of(lock)
    if info.st_uid != os.getuid():
        return f"it belongs to user id {info.st_uid}, whose processes this launcher cannot look into"
    if kind not in LOCAL_FILE_SYSTEMS:
        return f"it is on a {kind or 'unknown'} file system ({mount}), which other machines may share"
    if in_container() and mount != "/":
        return f"it is in {mount}, mounted into this container, which other containers may share"
    return ""


def _remove_if_same(lock: str, info: os.stat_result) -> bool:
    """Remove ``lock`` if it is still the file ``info`` (not a new build's lock made meanwhile)."""
    moved = f"{lock}.stale.{os.getpid()}"
    try:
        os.rename(lock, moved)
    except FileNotFoundError:
        return False  # its builder removed it after all
    now = os.stat(moved)
    if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
        os.rename(moved, lock)  # a new build's: put it back
        return False
    os.unlink(moved)
    return True


def clear_stale_build_locks(root: str | None = None) -> list[str]:
    """Remove each build lock under ``root`` that no process holds, when that is certain (see the
    module's docstring); name at once each other lock nobody here holds, with what to remove.
    Returns the locks removed or named."""
    root = extensions_root(os.environ) if root is None else root
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        lock = os.path.join(root, name, "lock")
        try:
            info = os.stat(lock)
        except OSError:
            continue
        holders, complete = lock_holders(info)
        if holders:
            log(f"a build of the {name!r} op is running (pid {holders[0]}, lock {lock}): a worker that needs that op "
                f"waits for it")
            continue
        doubt = _doubt(lock, info) or ("" if complete else "this launcher cannot see every process of its user")
        if not doubt:
            time.sleep(RECHECK_S)  # (once, at start, and only when a lock is there)
            try:
                removed = not lock_holders(info)[0] and _remove_if_same(lock, info)
            except OSError as exc:
                doubt, removed = f"it could not be removed ({exc.strerror})", None
            if removed is not None:
                if removed:
                    found.append(lock)
                    log(f"removed {lock}: no process holds it (a build of the {name!r} op was killed midway); the op "
                        f"is built again when a worker needs it")
                continue
        found.append(lock)
        log(f"warning: {lock} is held by no process on this machine, but {doubt}: if no build of the {name!r} op is "
            f"running elsewhere, remove it (any worker that needs that op waits for it forever): rm {lock}")
    return found
