"""Recovery planning: which version to land on and where each rank's bytes come from.

Pure functions over what every rank reported after the new generation formed; every rank
computes the same plan from the same all-gathered report, so no one has to send it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import FatalError

SELF = -1
"""Source marker: the rank restores from its own snapshot (a survivor)."""
KEEPER = -2
"""Source marker: the rank (a spare that took it on its node) restores from the node keeper's segment."""
STRIPE = -3
"""Source marker, followed by the share holders: the rank is decoded from k of their zfec shares."""


@dataclass(frozen=True)
class Holdings:
    """What one rank of the new generation can offer."""

    own: frozenset[int] = frozenset()
    """Versions of its own unique state it still holds (empty for a spare that just joined)."""
    held: Mapping[int, frozenset[int]] = field(default_factory=dict)
    """Source rank -> versions of that source's mirror it holds (committed, and the one before
    while intact); a plain int stands for one version."""
    send_rate: float = 0.0
    """Measured bytes/s of its mirror sends (0 when unknown); weights the load split."""
    retained: frozenset[int] = frozenset()
    """Versions of this rank's state its node's keeper holds and this process verified (a spare
    that took the rank on the dead rank's node); no byte of them crosses the network."""
    shares: Mapping[int, frozenset[int]] = field(default_factory=dict)
    """Source rank -> versions of which this rank holds one zfec share of that source (tier 2 stripe)."""

    def __post_init__(self) -> None:
        for name in ("held", "shares"):
            object.__setattr__(self, name, {s: frozenset([v]) if isinstance(v, int) else frozenset(v)
                                            for s, v in getattr(self, name).items()})
        object.__setattr__(self, "retained", frozenset(self.retained))


@dataclass(frozen=True)
class RestorePlan:
    version: int
    """The version every rank lands on."""
    sources: dict[int, tuple[int, ...]]
    """Rank -> (SELF,) or the holder ranks its bytes are fetched from."""


class NoConsistentVersion(FatalError):
    """No version is held for every rank; the message says which ranks' state is lost."""


def choose_version(holdings: Sequence[Holdings], new_ranks: Sequence[int] = (), stripe_k: int = 0) -> RestorePlan:
    """The newest version available for every rank, from each rank's cheapest source.

    ``new_ranks`` are the ranks a spare took in this generation: their process state died with
    them, so they are restored from their node's keeper (when it retained the version) or
    from holders. A version is usable when every rank holds it itself, has it in its keeper,
    or some other rank holds a committed copy of it. Sources in order of cost: own snapshot,
    keeper (both local), peers' full copies, then a zfec decode from ``stripe_k`` of the
    peers' shares (``stripe_k`` > 0 when tier 2 is a stripe).
    """
    new = set(new_ranks)
    world = len(holdings)
    candidates = set()
    for r, h in enumerate(holdings):
        if r not in new:
            candidates |= set(h.own)
        candidates |= set(h.retained)
        for versions in h.held.values():
            candidates |= versions
        for versions in h.shares.values():
            candidates |= versions
    best_missing: list[int] | None = None
    for v in sorted(candidates, reverse=True):
        sources, missing = {}, []
        for r in range(world):
            if r not in new and v in holdings[r].own:
                sources[r] = (SELF,)
                continue
            if r in new and v in holdings[r].retained:
                sources[r] = (KEEPER,)
                continue
            holders = tuple(h for h in range(world) if h != r and v in holdings[h].held.get(r, ()))
            share_holders = tuple(h for h in range(world) if h != r and v in holdings[h].shares.get(r, ()))
            if holders:
                sources[r] = holders
            elif stripe_k and len(share_holders) >= stripe_k:
                sources[r] = (STRIPE, *share_holders)
            else:
                missing.append(r)
        if not missing:
            return RestorePlan(v, sources)
        if best_missing is None:
            best_missing = missing
    def shares_of(r: int) -> int:
        return max((sum(1 for h in range(world) if h != r and v in holdings[h].shares.get(r, ())) for v in candidates),
                   default=0)

    lost = [r for r in range(world) if not any(holdings[h].held.get(r) for h in range(world) if h != r)
            and (r in new or not holdings[r].own) and not holdings[r].retained
            and not (stripe_k and shares_of(r) >= stripe_k)]
    if not candidates:
        detail = "no rank holds any version"
    elif lost:
        detail = f"every copy of rank(s) {', '.join(map(str, lost))} is lost"
    else:
        detail = (f"at the newest version held anywhere ({max(candidates)}), no copy exists of rank(s) "
                  f"{', '.join(map(str, best_missing))}, and no older version is held for every rank")
    raise NoConsistentVersion(f"no version of the training state is held for every rank: {detail} "
                              f"(lost ranks this generation: {sorted(new) or 'none'})")


def split_load(nbytes: int, holders: Sequence[int], rates: Sequence[float], align: int = 64) -> list[tuple[int, int, int]]:
    """Split a ``nbytes`` restore across ``holders`` in proportion to their ``rates``.

    Returns (holder, offset, length) ranges that tile [0, nbytes) in order, with every boundary
    a multiple of ``align``. Unknown (zero) rates count as the mean of the known ones, or as
    equal when none is known. A holder whose share rounds to nothing is left out.
    """
    if not holders:
        raise ValueError("split_load needs at least one holder")
    if len(rates) != len(holders):
        raise ValueError(f"{len(holders)} holders but {len(rates)} rates")
    known = [r for r in rates if r > 0]
    fill = sum(known) / len(known) if known else 1.0
    weights = [r if r > 0 else fill for r in rates]
    total = sum(weights)
    out, offset, acc = [], 0, 0.0
    for i, (h, w) in enumerate(zip(holders, weights)):
        acc += w
        end = nbytes if i == len(holders) - 1 else min(nbytes, int(round(nbytes * acc / total / align)) * align)
        if end > offset:
            out.append((h, offset, end - offset))
            offset = end
    return out
