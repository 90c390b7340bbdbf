"""The data position of a training loop that reads from a stateful iterator (a DataLoader).

hotspare lands every rank on the newest version all ranks hold, and ``steps`` re-yields the
interrupted iteration: its batches must come again. A loop whose batches are a function of the
step index needs nothing (pass ``data_state=STEP_INDEXED`` to say so). A loop that calls
``next(iterator)`` does: :class:`DataPosition` counts the batches taken, travels with the state
(``data_state=position.state, load_data_state=position.load``) and rebuilds the iterator at
the restored count, whether the iterator exists yet or not (a spare restores inside
``initialize``, before its script builds the iterator)::

    position = hotspare.DataPosition()
    session = initialize(..., data_state=position.state, load_data_state=position.load)
    batches = position.iterate(lambda start: skip(DataLoader(dataset, batch_size=8), start))

``make(start)`` must give the same sequence of batches every time it is called, from batch
``start`` on: a sampler that is seeded, or that takes a consumed-samples count (Megatron-LM's
``MegatronPretrainingSampler``). A ``DataLoader`` with ``shuffle=True`` and no ``generator``
draws a new order from torch's global generator at each ``iter()`` and cannot be repositioned.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

STEP_INDEXED = "step-indexed"
"""``data_state=STEP_INDEXED``: the loop's batches are a function of the step (nothing to carry)."""


def skip(iterable: Iterable, count: int) -> Iterator:
    """An iterator over ``iterable`` from its item ``count`` on (the first ``count`` are read and
    dropped: O(count); a sampler that starts at a position is faster where there is one)."""
    it = iter(iterable)
    next(itertools.islice(it, count, count), None)
    return it


class DataPosition:
    """Batches taken from a rebuildable iterator, carried with hotspare's state."""

    def __init__(self) -> None:
        self.consumed = 0
        """Batches taken so far (after a restore: the restored count)."""
        self._make: Callable[[int], Iterator] | None = None
        self._iterator: Iterator | None = None

    def state(self) -> dict[str, Any]:
        """``data_state`` for ``initialize``."""
        return {"consumed": self.consumed}

    def load(self, state: dict[str, Any]) -> None:
        """``load_data_state`` for ``initialize``: the next batch is rebuilt from the restored count
        (parked until :meth:`iterate` is called, on a spare)."""
        consumed = state.get("consumed") if isinstance(state, dict) else None
        if not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"the restored data position {state!r} has no 'consumed' count: was it saved by a "
                             f"hotspare.DataPosition?")
        self.consumed = consumed
        self._iterator = None

    def iterate(self, make: Callable[[int], Iterator]) -> "DataPosition":
        """Read batches from ``make(start)`` (built at the current count, and again after each
        restore); returns this object, an iterator."""
        self._make = make
        self._iterator = None
        return self

    def __iter__(self) -> "DataPosition":
        return self

    def __next__(self):
        if self._make is None:
            raise RuntimeError("DataPosition: call iterate(make) before reading batches")
        if self._iterator is None:
            self._iterator = iter(self._make(self.consumed))
        item = next(self._iterator)
        self.consumed += 1
        return item


def data_hooks(data_state, load_data_state) -> tuple[Callable | None, Callable | None, bool]:
    """Check ``initialize``'s data hooks: (data_state, load_data_state, whether the loop said how
    its data position is kept). ``data_state=STEP_INDEXED`` says the batches are a function of
    the step; a ``data_state`` without a ``load_data_state`` (or the reverse) is a mistake."""
    if isinstance(data_state, str):
        if data_state != STEP_INDEXED:
            raise ValueError(f"data_state={data_state!r}: pass a function returning the data position, or "
                             f"hotspare.STEP_INDEXED when the batches are a function of the step")
        return None, None, True
    if (data_state is None) != (load_data_state is None):
        raise ValueError("data_state and load_data_state go together: one saves the data position, the other "
                         "puts it back (hotspare.DataPosition has both: .state and .load)")
    return data_state, load_data_state, data_state is not None


NO_DATA_HOOKS = ("no data_state was passed to initialize: hotspare takes the batches to be a function of the step "
                 "(a recovery re-runs the interrupted step and expects the same batches). If the loop reads them "
                 "from an iterator (a DataLoader), a recovery would shift the data on every rank: carry its "
                 "position with hotspare.DataPosition (docs/your-model.md). Pass data_state=hotspare.STEP_INDEXED "
                 "to say the batches are a function of the step and silence this.")
