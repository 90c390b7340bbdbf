"""Environment variables hotspare reads or sets, and process-level set-up.

Every ``HOTSPARE_*`` name lives here. The launcher sets the torchrun-compatible ones
(RANK, WORLD_SIZE, ...) too, so a worker started by ``hotspare-run`` also works with
code written for torchrun.
"""
from __future__ import annotations

import os
import random

# Set by hotspare-run for every worker.
HOTSPARE_STORE_HOST = "HOTSPARE_STORE_HOST"
HOTSPARE_STORE_PORT = "HOTSPARE_STORE_PORT"
HOTSPARE_NODE_RANK = "HOTSPARE_NODE_RANK"
HOTSPARE_NUM_NODES = "HOTSPARE_NUM_NODES"
HOTSPARE_JOB_ID = "HOTSPARE_JOB_ID"
HOTSPARE_GENERATION = "HOTSPARE_GENERATION"
# "active" (started with a rank) or "spare" (waits for a takeover order).
HOTSPARE_ROLE = "HOTSPARE_ROLE"
# This process's worker id in the control store (a<rank> or s<node>.<k>).
HOTSPARE_WORKER_ID = "HOTSPARE_WORKER_ID"
# Unix socket of this (logical) node's keeper (hotspare.keeper).
HOTSPARE_KEEPER_SOCKET = "HOTSPARE_KEEPER_SOCKET"
# The job secret (hex) that signs every control-store value (hotspare.control.auth); never logged.
HOTSPARE_JOB_SECRET = "HOTSPARE_JOB_SECRET"
# Seconds a worker waits for the store and for the first rendezvous.
HOTSPARE_STORE_TIMEOUT_S = "HOTSPARE_STORE_TIMEOUT_S"

DS_ACCELERATOR = "DS_ACCELERATOR"


def accelerator_available() -> bool:
    """True when a CUDA device is usable (checked without initialising CUDA in the parent)."""
    import torch

    return torch.cuda.is_available()


def configure_accelerator() -> str:
    """Pick DeepSpeed's accelerator: keep a user's DS_ACCELERATOR, else cpu when no GPU exists.

    Must run before ``import deepspeed`` (DeepSpeed resolves its accelerator once).
    """
    if DS_ACCELERATOR not in os.environ and not accelerator_available():
        os.environ[DS_ACCELERATOR] = "cpu"
    return os.environ.get(DS_ACCELERATOR, "cuda")


def make_deterministic(seed: int, num_threads: int = 1) -> None:
    """Seed every RNG and pin thread counts so two runs with one seed are bitwise equal.

    The seed is the same on every rank: model initialisation must agree. Per-rank streams
    (dropout) differ because their inputs differ, and the RNG state is captured per rank.
    """
    import numpy as np
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(num_threads)
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"environment variable {name} is not set; start this script with hotspare-run "
                f"(or torchrun, for the variables torchrun sets)")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None
