"""The control store's operations for moving ranks on purpose: a straggler's or an operator's
handover (``handover/<i>``), a node's or a rank's drain (``drain/<i>``, ``drained/<n>``,
``moved/<rank>``), and what the
straggler test reads (``stragglers``, ``compute/<wid>``). Mixed into :class:`.store.ControlStore`,
whose signed ``put``/``text``/``append`` they use."""
from __future__ import annotations

from . import keys
from .lists import ListCursor
from .messages import Compute, Drain, Handover, StragglerPolicy, parse, to_json


class Moves:
    def ask_handover(self, order: Handover) -> int:
        return self.append(keys.HANDOVER, to_json(order))

    def handovers(self, start: int | ListCursor) -> tuple[list[Handover], int]:
        return self._entries(keys.HANDOVER, start)

    def ask_drain(self, node: int = -1, rank: int = -1) -> int:
        return self.append(keys.DRAIN, to_json(Drain(node=node, rank=rank)))

    def drains(self, start: int | ListCursor) -> tuple[list[Drain], int]:
        return self._entries(keys.DRAIN, start)

    def set_drained(self, node: int) -> None:
        self.put(keys.drained(node), "1")

    def drained(self, node: int) -> bool:
        return self._has(keys.drained(node))

    def set_moved(self, rank: int, outcome: str) -> None:
        """A drained rank's outcome: ``moved to <wid>``, or ``refused: <why>``."""
        self.put(keys.moved(rank), outcome)

    def moved(self, rank: int) -> str | None:
        return self.text(keys.moved(rank))

    # ---- stragglers -------------------------------------------------------------------------
    def publish_stragglers(self, policy: StragglerPolicy) -> None:
        self.put(keys.STRAGGLERS, to_json(policy))

    def stragglers(self) -> StragglerPolicy | None:
        text = self.text(keys.STRAGGLERS)
        return None if text is None else parse(StragglerPolicy, text, keys.STRAGGLERS)

    def report_compute(self, wid: str, compute: Compute) -> None:
        self.put(keys.compute(wid), to_json(compute))

    def compute(self, wid: str) -> Compute | None:
        text = self.text(keys.compute(wid))
        return None if text is None else parse(Compute, text, keys.compute(wid))
