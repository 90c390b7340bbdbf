"""``hotspare-run``'s command line: torchrun's flags and hotspare's, into a :class:`LaunchSpec`."""
from __future__ import annotations

import argparse
import os
import sys

from .exits import BAD_LAUNCH_EXIT_CODE, say_exit, say_unexpected
from .launcher import run
from .processes import log
from .spec import LaunchSpec


def parse_args(argv: list[str] | None = None) -> LaunchSpec:
    p = argparse.ArgumentParser(prog="hotspare-run", description=__doc__.split("\n\n")[0])
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=0)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="HOST:PORT of the control store; overrides --master-addr/--master-port")
    p.add_argument("--logical-nodes", type=int, default=1)
    p.add_argument("--spares-per-node", "--spares_per_node", type=int, default=0)
    p.add_argument("--job-id", default="")
    p.add_argument("--store-timeout", type=float, default=60.0)
    p.add_argument("--stall-grace-s", type=float, default=5.0,
                   help="seconds every active worker has to report a failure its peers saw (or, at least, to "
                        "leave a failed generation) before it is killed as stuck")
    p.add_argument("--no-keeper", action="store_true",
                   help="start no keeper (ranks retain nothing outside their own processes)")
    p.add_argument("--spares-only", action="store_true",
                   help="join a running job as a replacement node that brings spares only (--node-rank >= "
                        "--nnodes, the job's --master-addr/--master-port)")
    p.add_argument("--spare-wait-s", type=float, default=0.0,
                   help="when more ranks fail than spares are ready, wait this long for spares (e.g. from a "
                        "--spares-only launcher) before stopping the job; 0: stop at once")
    p.add_argument("--node-timeout-s", type=float, default=10.0,
                   help="with --nnodes > 1: node 0 declares a node lost when its launcher is silent this long, "
                        "and a launcher cut off from the store this long stops its workers")
    p.add_argument("--successor-wait-s", type=float, default=30.0,
                   help="after a takeover, start the promoted spare's successor once the recovered generation "
                        "is back at the interrupted step, when another failure comes, or after this many "
                        "seconds at most (its warm-up then does not compete with the recovery); 0: at once")
    p.add_argument("--advertise-addr", default="",
                   help="this node's address for the workers' collectives (default: the one that reaches "
                        "--master-addr); its interface becomes GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME")
    p.add_argument("--job-secret-file", default=os.environ.get("HOTSPARE_JOB_SECRET_FILE", ""),
                   help="the job secret that signs the control store's messages: the same owner-only file on "
                        "every node (required with --nnodes > 1 or --spares-only; default: "
                        "$HOTSPARE_JOB_SECRET_FILE; one machine: made by node 0)")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    addr, port = a.master_addr, a.master_port
    if a.rdzv_endpoint:
        addr, _, port_s = a.rdzv_endpoint.rpartition(":")
        if not addr or not port_s.isdigit():
            p.error(f"--rdzv-endpoint={a.rdzv_endpoint!r} must be HOST:PORT")
        port = int(port_s)
    script = (["-m"] if a.module else []) + [a.script, *a.script_args]
    return LaunchSpec(script=script, nproc_per_node=a.nproc_per_node, nnodes=a.nnodes, node_rank=a.node_rank,
                      master_addr=addr, master_port=port, logical_nodes=a.logical_nodes,
                      spares_per_node=a.spares_per_node, job_id=a.job_id,
                      store_timeout_s=a.store_timeout, stall_grace_s=a.stall_grace_s, keeper=not a.no_keeper,
                      advertise_addr=a.advertise_addr, node_timeout_s=a.node_timeout_s, spares_only=a.spares_only,
                      spare_wait_s=a.spare_wait_s, successor_wait_s=a.successor_wait_s,
                      job_secret_file=a.job_secret_file)


def main(argv: list[str] | None = None) -> int:
    """hotspare-run (``hotspare-run drain ...``: :func:`.draining.main`). Its last line says the
    exit code and why, however it ends."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["drain"]:
        from .draining import main as drain

        return drain(args[1:])
    try:
        try:
            spec = parse_args(argv)
        except SystemExit as exc:  # argparse said what is wrong (or printed --help: exit 0)
            if exc.code in (0, None):
                raise
            say_exit(BAD_LAUNCH_EXIT_CODE, "refused: the command line (argparse's message above)")
            return BAD_LAUNCH_EXIT_CODE
        spec.validate()
        return run(spec)
    except (ValueError, ConnectionError) as exc:  # a flag, the store's address, another job's store
        log(f"error: {exc}")
        say_exit(BAD_LAUNCH_EXIT_CODE, f"refused: {exc}")
        return BAD_LAUNCH_EXIT_CODE
    except Exception as exc:  # noqa: BLE001 - anything else: its traceback, then the last line
        return say_unexpected(exc)
