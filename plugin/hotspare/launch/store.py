"""The job's control store: node 0's launcher owns it (a TCPStore listening on the launcher's
address only) and publishes the job's id, signed; every other node's launcher joins it and takes
that id, refused without the job's secret."""
from __future__ import annotations

import datetime

from .. import control
from ..control import auth
from .network import listen_socket
from .spec import LaunchSpec


def open_store(spec: LaunchSpec, signer: auth.Signer):
    """(raw store, its signed view, the signer for the job's id, the store's port)."""
    import torch.distributed as dist

    from ..generation import connect_store

    s = spec
    if s.node_rank != 0:
        store = connect_store(s.master_addr, s.master_port, s.store_timeout_s)
        try:
            theirs = control.ControlStore(store, signer).job_id()
        except control.BadMessage as exc:
            raise ValueError(f"the control store at {s.master_addr}:{s.master_port}: {exc}; give every "
                             f"node's hotspare-run the same --job-secret-file") from None
        if theirs is None:
            raise ValueError(f"the control store at {s.master_addr}:{s.master_port} serves no job yet (node 0's "
                             f"hotspare-run writes its id first)")
        if s.job_id and s.job_id != theirs:
            raise ValueError(f"--job-id={s.job_id}, but the control store at {s.master_addr}:{s.master_port} "
                             f"serves job {theirs}: start every node's hotspare-run with the same --job-id (or "
                             f"none: the others take node 0's)")
        signer = signer.for_job(theirs)
        return store, control.ControlStore(store, signer), signer, s.master_port
    # The store listens on the address the launcher was given only (127.0.0.1 on one
    # machine), not on every interface as TCPStore's own socket would.
    listener = listen_socket(s.master_addr, s.master_port)
    store = dist.TCPStore(s.master_addr, listener.getsockname()[1], is_master=True,
                          timeout=datetime.timedelta(seconds=s.store_timeout_s), wait_for_workers=False,
                          master_listen_fd=listener.fileno())
    listener.detach()  # the store owns the descriptor now and closes it when it goes
    ctl = control.ControlStore(store, signer)
    ctl.publish_job(signer.job_id)
    return store, ctl, signer, store.port
