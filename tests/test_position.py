"""hotspare.DataPosition (in process): a stateful iterator's position saved, restored and
rebuilt whether the iterator exists yet or not; initialize's data hooks checked."""
from __future__ import annotations

import pytest

import hotspare
from hotspare.position import data_hooks


def test_a_restore_rebuilds_the_iterator_at_the_saved_count():
    made = []

    def make(start):
        made.append(start)
        return hotspare.skip(range(100), start)

    pos = hotspare.DataPosition()
    it = pos.iterate(make)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    saved = pos.state()
    assert saved == {"consumed": 5}
    assert [next(it) for _ in range(3)] == [5, 6, 7]  # the interrupted iteration read these
    pos.load(saved)  # a survivor lands on the saved version
    assert [next(it) for _ in range(3)] == [5, 6, 7] and made == [0, 5]


def test_a_spare_restores_before_its_iterator_exists():
    pos = hotspare.DataPosition()
    pos.load({"consumed": 42})  # inside initialize, before the script builds its iterator
    it = pos.iterate(lambda start: hotspare.skip(range(100), start))
    assert next(it) == 42 and pos.state() == {"consumed": 43}


def test_reading_before_iterate_and_a_foreign_position_are_refused():
    pos = hotspare.DataPosition()
    with pytest.raises(RuntimeError, match="iterate"):
        next(pos)
    with pytest.raises(ValueError, match="consumed"):
        pos.load({"step": 3})


def test_initialize_data_hooks():
    assert data_hooks(hotspare.STEP_INDEXED, None) == (None, None, True)
    assert data_hooks(None, None) == (None, None, False)
    pos = hotspare.DataPosition()
    assert data_hooks(pos.state, pos.load) == (pos.state, pos.load, True)
    with pytest.raises(ValueError, match="go together"):
        data_hooks(pos.state, None)
    with pytest.raises(ValueError, match="STEP_INDEXED"):
        data_hooks("step", None)
