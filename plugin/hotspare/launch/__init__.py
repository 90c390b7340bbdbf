"""hotspare-run: the per-node launcher.

It mirrors torchrun's flags, starts this node's workers, and owns the control store
(a TCPStore on node 0) so the store outlives any worker. Workers get torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
plus the ``HOTSPARE_*`` variables of :mod:`hotspare.env`.

``--logical-nodes L`` splits one machine's workers into L logical nodes (for tests and
recipes that need "other nodes" on one host); each worker's HOTSPARE_NODE_RANK is its
logical node.

Before its workers it starts one keeper per (logical) node (:mod:`hotspare.keeper`): the
process that owns the node's retained shared-memory segments; it is stopped after them and
then removes every segment.

The package: :mod:`.spec` (what one launcher starts, checked), :mod:`.cli` (the flags),
:mod:`.launcher` (the loop: start, watch, follow plans, end), :mod:`.processes` (a worker's
process: failing exits seen early, parent-death, stacks, signals), :mod:`.keepers`,
:mod:`.fencing` (a node's heartbeat to node 0 and fencing), :mod:`.network` (addresses),
:mod:`.buildlocks` (torch's extension builds), :mod:`.exits` (exit codes and the last line).
"""
from __future__ import annotations

from .buildlocks import clear_stale_build_locks, extensions_root
from .cli import main, parse_args
from .exits import ABORT_EXIT_CODE, BAD_CONTROL_EXIT_CODE, BAD_LAUNCH_EXIT_CODE, FENCED_EXIT_CODE
from .fencing import FENCE_GRACE_S
from .launcher import POLL_INTERVAL_S, Launcher, run
from .network import interface_of, listen_socket, route_to
from .processes import Worker, die_with_parent, dump_stacks
from .spec import LaunchSpec

__all__ = ["clear_stale_build_locks", "extensions_root", "main", "parse_args", "ABORT_EXIT_CODE",
           "BAD_CONTROL_EXIT_CODE", "BAD_LAUNCH_EXIT_CODE", "FENCE_GRACE_S",
           "FENCED_EXIT_CODE", "POLL_INTERVAL_S", "Launcher", "run", "interface_of", "listen_socket", "route_to",
           "Worker", "die_with_parent", "dump_stacks", "LaunchSpec"]
