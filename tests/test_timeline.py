"""The pipeline timeline picture (autopart/runtime/timeline.py) and ``autopart timeline``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autopart.cli import main
from autopart.errors import AutopartError
from autopart.runtime.timeline import (
    blocks,
    busy_fractions,
    chrome_event,
    event_action,
    load_trace,
    plot_timeline,
)
from autopart.schedule.ir import Action

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1.7e15  # µs since the epoch, as time.time() × 1e6 gives


def _event(action: Action, rank: int, start: float, dur: float) -> dict[str, Any]:
    """``chrome_event``'s event of ``action``, with times given exactly in µs."""
    return {**chrome_event(action, 0.0, 0.0, rank), "ts": T0 + start, "dur": dur}


def synthetic() -> list[dict[str, Any]]:
    """2 ranks × F and B of 2 micro-batches × 2 chunks, a SEND and a DP_REDUCE: 0..200 µs.

    Rank 0 computes F 0..40 and B 120..160 (8 × 10 µs): busy 80 of 200. Rank 1 computes F
    40..100 and B 95..155 (8 × 15 µs, its first B overlapping its last F by 5 µs, counted once),
    then reduces 190..200: busy 115 of 200.
    """
    ev = []
    t = 0.0
    for mb in range(2):
        for c in range(2):
            ev.append(_event(Action("F", 0, mb, c), 0, t, 10))
            t += 10
    ev.append(_event(Action("SEND_F", 0, 1, 1, peer=1), 0, 40, 5))
    t = 120.0
    for mb in range(2):
        for c in reversed(range(2)):
            ev.append(_event(Action("B", 0, mb, c), 0, t, 10))
            t += 10
    t = 40.0
    for mb in range(2):
        for c in range(2):
            ev.append(_event(Action("F", 1, mb, c), 1, t, 15))
            t += 15
    t = 95.0  # overlaps the last forward (95..100): counted once
    for mb in range(2):
        for c in reversed(range(2)):
            ev.append(_event(Action("B", 1, mb, c), 1, t, 15))
            t += 15
    ev.append(_event(Action("DP_REDUCE", 1), 1, 190, 10))
    return ev


ACTIONS = [
    Action("F", 0, 1, 2),
    Action("B", 1, 0),
    Action("SEND_F", 0, 1, peer=1),
    Action("RECV_B", 2, 3, 1, peer=0),
    Action("DP_REDUCE", 3),  # the stage it reduces: not in the name, kept in args
    Action("TIE_REDUCE"),
]


def test_event_round_trip() -> None:
    """event → Action → event gives the same event, through JSON too."""
    for a in ACTIONS:
        e = chrome_event(a, 1.5, 1.75, pid=3)
        back = event_action(json.loads(json.dumps(e)))
        assert back == a
        assert chrome_event(back, 1.5, 1.75, pid=3) == e
    e = chrome_event(Action("F", 0, 1, 2), 1.5, 1.75, pid=3)
    assert e == {
        "name": "F(s0,m1,c2)",
        "cat": "F",
        "ph": "X",
        "pid": 3,
        "tid": 0,
        "ts": 1.5e6,
        "dur": 0.25e6,
        "args": {"kind": "F", "stage": 0, "mb": 1, "chunk": 2, "peer": None},
    }
    assert json.loads(json.dumps(e))["args"]["peer"] is None  # null in the file


def test_event_without_autopart_args_has_no_action() -> None:
    """The name is never parsed: only ``args`` say which action an event is."""
    named = {"name": "F(s0,m1)", "cat": "F", "ph": "X", "pid": 0, "ts": 0, "dur": 1}
    assert event_action(named) is None
    good = chrome_event(Action("B", 1, 2), 0.0, 1.0, 0)
    for args in [
        None,
        {},
        {"External id": 7},  # another tool's args
        {**good["args"], "kind": "OPTIMIZER"},
        {**good["args"], "stage": -1},
        {**good["args"], "mb": "2"},
        {**good["args"], "chunk": 0.5},
        {**good["args"], "peer": True},
    ]:
        assert event_action({**good, "args": args}) is None, args


def test_foreign_events_are_plain_blocks_of_their_cat(tmp_path: Path) -> None:
    foreign = [
        {"name": "F(s0,m0)", "cat": "F", "ph": "X", "pid": 0, "ts": T0, "dur": 10},
        {"name": "aten::mm", "cat": "cpu_op", "ph": "X", "pid": 0, "ts": T0 + 10, "dur": 5},
        {"name": "step", "ph": "X", "pid": 1, "ts": T0, "dur": 20, "args": {"External id": 3}},
    ]
    bs = blocks(foreign)
    assert [(b.rank, b.kind, b.action) for b in bs] == [
        (0, "F", None),
        (0, "cpu_op", None),
        (1, "?", None),
    ]
    assert busy_fractions(foreign) == {0: 0.5, 1: 0.0}
    assert plot_timeline(foreign, tmp_path / "f.png").read_bytes()[:8] == PNG_MAGIC


def test_busy_fractions_exact() -> None:
    ev = synthetic()
    assert busy_fractions(ev) == {0: 80 / 200, 1: (155 - 40) / 200}
    assert busy_fractions(ev) == {0: 0.4, 1: 0.575}
    assert busy_fractions([]) == {}


def test_blocks_kinds_and_chunks() -> None:
    bs = blocks([*synthetic(), {"name": "process_name", "ph": "M", "pid": 0}])
    assert len(bs) == 18  # the metadata event is skipped
    assert {b.rank for b in bs} == {0, 1}
    assert {b.action.chunk for b in bs if b.kind in ("F", "B")} == {0, 1}
    assert [b.action for b in bs if b.kind == "SEND_F"] == [Action("SEND_F", 0, 1, 1, peer=1)]
    assert [b.action for b in bs if b.kind == "DP_REDUCE"] == [Action("DP_REDUCE", 1)]


def test_plot_writes_png(tmp_path: Path) -> None:
    out = plot_timeline(synthetic(), tmp_path / "sub" / "t.png", title="synthetic")
    assert out == tmp_path / "sub" / "t.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_empty_input_refused(tmp_path: Path) -> None:
    with pytest.raises(AutopartError, match="no timeline events"):
        plot_timeline([], tmp_path / "t.png")
    with pytest.raises(AutopartError, match="no timeline events"):
        plot_timeline([{"name": "x", "ph": "M", "pid": 0}], tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_load_trace_round_trip(tmp_path: Path) -> None:
    ev = synthetic()
    (tmp_path / "a.json").write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ms"}))
    (tmp_path / "b.json").write_text(json.dumps(ev))
    assert load_trace(tmp_path / "a.json") == ev
    assert load_trace(tmp_path / "b.json") == ev
    (tmp_path / "bad.json").write_text('{"traceEvents": 3}')
    with pytest.raises(AutopartError, match="no trace events"):
        load_trace(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(AutopartError, match="not a readable trace JSON"):
        load_trace(tmp_path / "broken.json")
    (tmp_path / "long.json").write_text('{"traceEvents": ' + "9" * 5000 + "}")
    (tmp_path / "deep.json").write_text("[" * 50000 + "]" * 50000)
    for name in ("long.json", "deep.json"):  # raw ValueError / RecursionError before
        with pytest.raises(AutopartError, match="not a readable trace JSON"):
            load_trace(tmp_path / name)
    with pytest.raises(AutopartError, match="no trace file"):
        load_trace(tmp_path / "missing.json")


def test_cli_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": synthetic()}))
    assert main(["timeline", str(trace)]) == 0
    assert (tmp_path / "trace.png").read_bytes()[:8] == PNG_MAGIC
    assert "rank 1: 57.5% busy" in capsys.readouterr().out
    (tmp_path / "empty.json").write_text('{"traceEvents": []}')
    assert main(["timeline", str(tmp_path / "empty.json"), "-o", str(tmp_path / "e.png")]) == 2
    assert "no timeline events" in capsys.readouterr().err
