"""Who may join a job: the job id every process carries, and a fingerprint of what it runs.

The control store (node 0's ``hotspare-run``) holds the job's id (``job/id``) and the
fingerprint of the first worker that joined (``job/fingerprint``). Every join of a generation
checks the id, so a process of another job that reaches this store (a stale worker, a
launcher started with the wrong ``--master-port``) is refused instead of being counted as a
rank; every worker checks its fingerprint when it starts, so a spare or a node started with
another script, config or package version is refused at once, naming both fingerprints,
instead of taking a rank and training on different code.

The fingerprint covers the training script's bytes, the config (DeepSpeed's, with its
``"hotspare"`` section; megatron-core's parallel layout and hotspare section) and the versions
of Python, torch, hotspare and the host framework. It does not cover the command line's other
arguments (paths may differ from node to node).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Mapping

from . import env
from .control import BadMessage, ControlStore
from .control.auth import SecretError
from .errors import FatalError

CHECK_WAIT_S = 3.0
"""How long a joining process looks again at a job id or fingerprint that does not verify before
it is refused: a stranger may have written over it, and node 0's launcher puts the job's back
within a second (:meth:`~.control.ControlStore.guard_identity`)."""
_confirmed: set[tuple] = set()  # (job id, secret, store) this process checked: a later join need not read again


class JoinRefused(FatalError):
    """This process belongs to another job, or runs something other than the job does."""


def fingerprint(config: Mapping | None, versions: Mapping[str, str] | None = None,
                script: str | None = None) -> str:
    """16 hex digits over the script's bytes, ``config`` (as sorted JSON) and the versions."""
    import torch

    from . import __version__

    h = hashlib.sha256()
    script = script if script is not None else (sys.argv[0] if sys.argv and sys.argv[0] else "")
    if script and os.path.isfile(script):
        with open(script, "rb") as f:
            h.update(f.read())
    h.update(json.dumps(config or {}, sort_keys=True, default=str).encode())
    all_versions = {"python": platform.python_version(), "torch": torch.__version__, "hotspare": __version__,
                    **(versions or {})}
    h.update(json.dumps(all_versions, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _verified(read, what: str):
    """``read()``'s value, looked at again for up to CHECK_WAIT_S while it does not verify; then
    JoinRefused naming ``what`` and why."""
    deadline = time.monotonic() + CHECK_WAIT_S
    while True:
        try:
            return read()
        except (BadMessage, SecretError) as exc:
            if isinstance(exc, SecretError) or time.monotonic() > deadline:
                raise JoinRefused(f"{what}: {exc}") from None
        time.sleep(0.1)


def check_job(store) -> None:
    """Refuse to join unless the store's job id is this process's (``HOTSPARE_JOB_ID``), signed
    with this process's job secret; a process not started by hotspare-run (no id) or a store
    without one is not checked. Checked once per process: a later generation's join does not
    read it again (the job's plans are signed with the same secret)."""
    mine = os.environ.get(env.HOTSPARE_JOB_ID)
    checked = (mine, os.environ.get(env.HOTSPARE_JOB_SECRET), getattr(store, "host", None),
               getattr(store, "port", id(store)))
    if not mine or store is None or checked in _confirmed:
        return
    where = f"{os.environ.get(env.HOTSPARE_STORE_HOST, '?')}:{os.environ.get(env.HOTSPARE_STORE_PORT, '?')}"
    theirs = _verified(lambda: ControlStore(store).job_id(), f"this process (job {mine}) cannot join the job at {where}")
    if theirs is not None and theirs != mine:
        raise JoinRefused(f"this process belongs to job {mine}, but the control store at {where} serves job {theirs}: "
                          f"it is not joining. Check --master-addr/--master-port (or --rdzv-endpoint) of its "
                          f"hotspare-run.")
    if theirs is not None:
        _confirmed.add(checked)


def check_fingerprint(store, mine: str, worker: str) -> None:
    """The first worker's fingerprint becomes the job's; refuse any worker whose differs."""
    if store is None:
        return
    theirs = _verified(lambda: ControlStore(store).claim_fingerprint(mine), f"worker {worker} cannot join")
    if theirs != mine:
        raise JoinRefused(f"worker {worker} runs a different script, config or package version than the job "
                          f"(fingerprint {mine}, the job's {theirs}: over the script's bytes, the config and the "
                          f"versions of Python, torch, hotspare and the host framework). Start every node's "
                          f"hotspare-run with the same script, config and environment.")
