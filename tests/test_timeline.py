"""The pipeline timeline picture (autopart/runtime/timeline.py) and ``autopart timeline``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autopart.cli import main
from autopart.errors import AutopartError
from autopart.runtime.timeline import blocks, busy_fractions, load_trace, parse_name, plot_timeline
from autopart.schedule.ir import Action

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1.7e15  # µs since the epoch, as time.time() × 1e6 gives


def _event(name: str, kind: str, rank: int, start: float, dur: float) -> dict[str, Any]:
    return {
        "name": name,
        "cat": kind,
        "ph": "X",
        "pid": rank,
        "tid": 0,
        "ts": T0 + start,
        "dur": dur,
    }


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
            a = Action("F", 0, mb, c)
            ev.append(_event(str(a), "F", 0, t, 10))
            t += 10
    ev.append(_event(str(Action("SEND_F", 0, 1, 1, peer=1)), "SEND_F", 0, 40, 5))
    t = 120.0
    for mb in range(2):
        for c in reversed(range(2)):
            ev.append(_event(str(Action("B", 0, mb, c)), "B", 0, t, 10))
            t += 10
    t = 40.0
    for mb in range(2):
        for c in range(2):
            ev.append(_event(str(Action("F", 1, mb, c)), "F", 1, t, 15))
            t += 15
    t = 95.0  # overlaps the last forward (95..100): counted once
    for mb in range(2):
        for c in reversed(range(2)):
            ev.append(_event(str(Action("B", 1, mb, c)), "B", 1, t, 15))
            t += 15
    ev.append(_event("DP_REDUCE", "DP_REDUCE", 1, 190, 10))
    return ev


def test_parse_name_reads_back_action_str() -> None:
    for a in [
        Action("F", 0, 1, 2),
        Action("B", 1, 0),
        Action("SEND_F", 0, 1, peer=1),
        Action("RECV_B", 2, 3, 1, peer=0),
        Action("DP_REDUCE"),
        Action("TIE_REDUCE"),
    ]:
        assert parse_name(str(a)) == a
    assert parse_name("F(s0,m1,c2)") == Action("F", 0, 1, 2)
    assert parse_name("B(s1,m0)").chunk == 0
    assert parse_name("optimizer") is None and parse_name("F") is None


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
    assert sum(b.kind == "SEND_F" for b in bs) == 1


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
