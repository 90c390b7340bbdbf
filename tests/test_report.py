"""hotspare.report: phases of a recovery read back from the event logs, the summary and the plot."""
from __future__ import annotations

import json

import pytest

from hotspare import report


def ev(t, kind, rank, generation, **fields):
    return {"t": t, "kind": kind, "rank": rank, "generation": generation, "version": fields.pop("version", None),
            **fields}


EVENTS = [
    ev(9.0, "step", 0, 0, version=4, seconds=0.1, worker="a0"),
    ev(10.05, "failure_seen", 0, 0, version=5), ev(10.08, "failure_seen", 2, 0, version=5),
    ev(10.30, "plan", 0, 1, replaced={"1": "s0.0"}, failures=[{"rank": 1, "reason": "exit"}]),
    ev(10.32, "plan", 2, 1, replaced={"1": "s0.0"}, failures=[{"rank": 1, "reason": "exit"}]),
    ev(10.31, "takeover", 1, 1, replaced={"1": "s0.0"}),
    ev(10.50, "rebuild", 0, 1), ev(10.52, "rebuild", 1, 1), ev(10.51, "rebuild", 2, 1),
    ev(10.55, "restore", 0, 1, version=5, source="self"), ev(10.56, "restore", 1, 1, version=5, source="peers"),
    ev(10.55, "restore", 2, 1, version=5, source="self"),
    ev(10.60, "resume", 0, 1, version=5, failed_at=5), ev(10.61, "resume", 1, 1, version=5),
    ev(10.60, "resume", 2, 1, version=5, failed_at=5),
    ev(10.7, "step", 1, 1, version=5, seconds=0.05, worker="s0.0"),
    # A later failure whose recovery never finished (the job stopped): not reported.
    ev(20.0, "failure_seen", 0, 1, version=9), ev(20.3, "plan", 0, 2, replaced={}, failures=[]),
]


def test_phases_are_the_slowest_ranks_boundaries():
    (s,) = report.recoveries(EVENTS, faults=[{"t": 10.0, "rank": 1, "step": 5}])
    d = s["durations"]
    assert s["generation"] == 1 and s["version"] == 5 and s["failed_at"] == 5
    assert d["detect"] == pytest.approx(0.05) and d["plan"] == pytest.approx(0.27)
    assert d["rebuild"] == pytest.approx(0.20) and d["restore"] == pytest.approx(0.04)
    assert d["resume"] == pytest.approx(0.05) and s["total"] == pytest.approx(0.61)
    assert s["replaced"] == {"1": "s0.0"} and s["sources"] == ["peers", "self"] and s["fallback"] is None


def test_without_a_known_fault_detection_is_unknown_and_total_starts_at_the_first_sighting(capsys):
    (s,) = report.recoveries(EVENTS)
    assert s["durations"]["detect"] is None and s["total"] == pytest.approx(0.56)
    report.print_recoveries([s])
    out = capsys.readouterr().out
    assert "recovery 1: rank 1 exit; rank 1 -> s0.0; resumed at step 5" in out and "detect   unknown" in out


def test_load_and_plot(tmp_path):
    for rank in (0, 1, 2):
        with open(tmp_path / f"events.rank{rank}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(e) + "\n" for e in EVENTS if e["rank"] == rank)
    events = report.load_events(str(tmp_path))
    assert len(events) == len(EVENTS) and [e["t"] for e in events] == sorted(e["t"] for e in EVENTS)
    faults = [{"t": 10.0, "rank": 1, "step": 5}]
    path = report.plot_timeline(events, report.recoveries(events, faults), str(tmp_path / "t.png"), faults)
    assert open(path, "rb").read(4) == b"\x89PNG"
