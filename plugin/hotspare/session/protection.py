"""Protecting a rank's state in a generation: hotspare's own groups, where each rank's copies go
(tier 2: full mirrors placed on other nodes, or a zfec stripe), the keeper's buffers as the
rank's snapshots (tier 1), and the mirror seeded with the state as it is now."""
from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import erasure
from ..config import ConfigError
from ..events import log
from ..mirror import Mirror
from ..slots import Inherited
from ..placement import place
from ..startup import node_ranks
from ..transport import GlooTransport


def hotspare_groups(session) -> tuple:
    """The mirror's data and control groups for the current generation (gloo, host memory)."""
    timeout = datetime.timedelta(seconds=session.config.mirror.timeout_s)
    # Mirror bytes and the per-step agreement get groups of their own, so they never queue
    # behind the training collectives.
    data_group = dist.new_group(backend="gloo", timeout=timeout)
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    session.groups = (data_group, control_group)
    return data_group, control_group


def _holders(session, nodes: list[int], control_group) -> tuple[dict, tuple[int, int] | None]:
    """Where each rank's copies go ({rank: [holders]}) and the stripe's (k, m), or None for full
    copies. A stripe the job's nodes can no longer carry after a recovery falls back to copies."""
    cfg, gen = session.config, session.generation
    mc, rc = cfg.mirror, cfg.retain
    stripe = (rc.k, rc.m) if rc.tier2 == "stripe" else None
    try:
        if stripe is None:
            return place(nodes, mc.replicas, stage_of_rank=session.stages(control_group)), None
        try:
            rc.check_nodes(len(set(nodes)))
            return erasure.place_shares(nodes, rc.k, rc.m), stripe
        except ValueError as exc:
            if gen.index == 0:
                raise
            # A spare of another node took a lost node's rank: the job has fewer nodes than the
            # stripe needs. Protect with full copies until it ends (better than stopping a job
            # that can go on).
            log(f"rank {gen.rank}: generation {gen.index} cannot stripe ({exc}); tier 2 falls back to "
                f"mirror copies (mirror.replicas={max(1, mc.replicas)}) for the rest of the job")
            session.events("tier2_degraded", reason=str(exc), nodes=nodes)
            return place(nodes, max(1, mc.replicas)), None
    except ValueError as exc:
        key = "retain.k/m" if stripe is not None else f"mirror.replicas={mc.replicas}"
        raise ConfigError(f"hotspare.{key}: {exc}") from None


def start_mirror(session, data_group, control_group, inherit: Callable[[], Inherited | None] = lambda: None,
                 landing: tuple[int, list] | None = None) -> None:
    """Start mirroring in the current generation and seed it with the state as it is now
    (``inherit()``: the last generation's own snapshot buffers, reused: no allocation;
    ``landing``: (version, every rank's holdings) after a restore from memory: the first
    round moves that version only where it is not held yet)."""
    cfg, gen = session.config, session.generation
    mc = cfg.mirror
    if not (mc.enabled and (mc.replicas > 0 or session.keeper is not None or cfg.retain.tier2 == "stripe")
            and gen.world_size > 1):
        return
    nodes = node_ranks(control_group)
    holders, stripe = _holders(session, nodes, control_group)
    snapshots = None
    if session.keeper is not None:
        def note(text: str) -> None:
            log(f"rank {gen.rank}: {text}")
            session.events("retain_budget", note=text)

        snapshots = session.keeper.snapshots_for(gen.rank, mc.chunk_bytes, cfg.retain.budget_bytes, note,
                                                 session.pin_memory, session.keeper.device_index())

    def agree(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group)

    session.mirror = Mirror(gen.rank, gen.index, holders, GlooTransport(data_group, gen.rank), agree,
                            in_flight=mc.in_flight, chunk_bytes=mc.chunk_bytes, timeout_s=mc.timeout_s,
                            pin_memory=session.pin_memory, on_event=session.events, snapshots=snapshots,
                            stripe=stripe, inherit=inherit())
    session.events("mirror_start", holders=holders[gen.rank], nodes=nodes, single_node=len(set(nodes)) == 1)
    # The state as it is now is a version too: a failure in the very next step lands here.
    held_by, held_from = [], []
    if landing is not None and stripe is None:
        version, holdings = landing
        me = gen.rank
        held_by = [h for h in holders.get(me, []) if version in holdings[h].held.get(me, ())]
        held_from = [s for s, hs in holders.items() if me in hs and version in holdings[me].held.get(s, ())]
    session.mirror.seed(session.step_count(), session.state.tensors, session.state.meta, reuse=landing is not None,
                        held_by=held_by, held_from=held_from)


def protect(session) -> None:
    """Generation 0's active ranks: hotspare's groups, then the mirror."""
    start_mirror(session, *hotspare_groups(session))
