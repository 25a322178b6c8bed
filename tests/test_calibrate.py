"""autopart/planning/calibrate.py: a measured trace gives back the per-action costs that made it, and
replaying them on the schedule IR gives back its step time; the CLI path refuses what it cannot
predict. (A real run's trace is read in tests/test_multirank.py::test_pipeline_trace_and_saved_bytes.)"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from autopart import AutopartError
from autopart.cli import main
from autopart.planning.calibrate import load, measure, predict
from autopart.planning.simulate import simulate_actions, to_chrome_trace
from autopart.runtime.timeline import VERSION, trace_document
from autopart.schedule import generate

P = 3
OVERHEAD = 0.004


def _costs(kind: str, stage: int, chunk: int) -> float:
    """Distinct costs per (kind, stage, chunk): a wrong key in measure() shows."""
    return (0.010 if kind == "F" else 0.021) + 0.001 * stage + 0.0003 * chunk


def _fake_trace(
    schedule: str, m: int, k: int = 1, v: int = 1, dp: int = 1, dp_cost: float = 0.003
) -> tuple[dict, float]:
    """A trace made by the simulator from known costs, as `autopart run --trace` writes one."""
    actions = {
        r: generate(schedule, r, m, list(range(P)), dp=dp, v=v, tied=r in (0, P - 1), k=k)
        for r in range(P)
    }

    def cost(a):
        if a.kind == "TIE_REDUCE":
            return 0.002
        if a.kind == "DP_REDUCE":
            return dp_cost
        return _costs(a.kind, a.stage, a.chunk)

    tl = simulate_actions(actions, cost, lambda a: 0.0015 if a.kind == "SEND_F" else 0.0007)
    events = to_chrome_trace(tl.events)
    for e in events:  # a real trace's clock starts anywhere
        e["ts"] += 1.7e15
    plan = {
        "schedule": schedule,
        "microbatches": m,
        "virtual_stages": v,
        "seq_chunks": k,
        "dp": dp,
        "tp": 1,
        "pp": P,
    }
    header = {
        "plan": plan,
        "microbatch_size": 2,
        "microbatch_tokens": 2 * 64,
        "step_s": tl.span + OVERHEAD,
        "ranks": {str(r): {"dp": 0, "tp": 0, "pp": r} for r in range(P)},
    }
    return trace_document(events, header), tl.span


@pytest.mark.parametrize(
    "schedule,k,v",
    [
        ("1f1b", 1, 1),
        ("gpipe", 1, 1),
        ("seq1f1b", 3, 1),
        ("interleaved-1f1b", 1, 2),
        ("seq1f1b-interleaved", 2, 2),
    ],
)
def test_measure_recovers_the_costs_and_predict_the_step(schedule: str, k: int, v: int) -> None:
    doc, span = _fake_trace(schedule, 6, k=k, v=v)
    m = measure(doc["traceEvents"], doc["autopart"])
    assert m.compute.keys() == {
        (kind, s, c) for kind in "FB" for s in range(P * v) for c in range(k)
    }
    for key, seconds in m.compute.items():
        assert seconds == pytest.approx(_costs(*key), abs=1e-6), key
    assert m.transfer[("SEND_F", 0)] == pytest.approx(0.0015, abs=1e-6)
    assert m.transfer[("SEND_B", 0)] == pytest.approx(0.0007, abs=1e-6)
    assert m.tie_reduce == pytest.approx(0.002, abs=1e-6)
    assert m.tied_pp_ranks == {0, P - 1}
    assert m.overhead_s == pytest.approx(OVERHEAD, abs=1e-6)
    same = predict(m)
    assert same.summary.iteration_s == pytest.approx(span + OVERHEAD, abs=1e-5)
    more = predict(m, microbatches=12)
    assert more.summary.iteration_s > same.summary.iteration_s
    assert more.summary.bubble_fraction < same.summary.bubble_fraction  # the bubble amortizes


def test_a_w_run_in_pieces_costs_their_sum() -> None:
    """The runtime may run a unit's W in pieces (some while a receive waited): measure() adds
    a unit's pieces up, so the W cost is the whole unit's."""
    doc, span = _fake_trace("zb-h1", 6)
    events = []
    for e in doc["traceEvents"]:
        if e.get("cat") == "W":  # the first third moves earlier, as a separate piece
            third = e["dur"] / 3
            events.append({**e, "ts": e["ts"] - 5e3, "dur": third})
            e = {**e, "ts": e["ts"] + third, "dur": e["dur"] - third}
        events.append(e)
    m = measure(events, doc["autopart"])
    assert {key for key in m.compute if key[0] == "W"} == {("W", s, 0) for s in range(P)}
    for key, seconds in m.compute.items():
        assert seconds == pytest.approx(_costs(*key), abs=1e-6), key


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("dp_cost", [0.003, 0.05, 0.2])  # hidden behind the last B, or not
def test_dp_reduce_wait_is_reproduced(schedule: str, v: int, dp_cost: float) -> None:
    doc, span = _fake_trace(schedule, 6, v=v, dp=2, dp_cost=dp_cost)
    m = measure(doc["traceEvents"], doc["autopart"])
    assert len(m.dp_reduce) == P  # one stage per pipeline rank carries its wait
    same = predict(m).summary
    assert same.iteration_s == pytest.approx(span + OVERHEAD, abs=1e-5)
    waits = [e["dur"] * 1e-6 for e in doc["traceEvents"] if e.get("cat") == "DP_REDUCE"]
    assert same.breakdown.dp_comm_s == pytest.approx(sum(waits) / P, abs=1e-5)
    if dp_cost > 0.021:  # longer than any B: the wait shows
        assert same.breakdown.dp_comm_s > 0.01


def test_breakdown_adds_up() -> None:
    doc, _ = _fake_trace("1f1b", 4, dp=2, dp_cost=0.05)
    s = predict(measure(doc["traceEvents"], doc["autopart"]), microbatches=8).summary
    assert sum(asdict(s.breakdown).values()) == pytest.approx(s.iteration_s, abs=1e-9)
    assert min(asdict(s.breakdown).values()) >= 0
    assert s.bubble_fraction == pytest.approx(s.breakdown.bubble_s / s.iteration_s)


def test_gpipe_from_a_1f1b_trace_has_the_same_work() -> None:
    doc, _ = _fake_trace("1f1b", 6)
    m = measure(doc["traceEvents"], doc["autopart"])
    g = predict(m, schedule="gpipe").summary
    assert g.breakdown.compute_s == pytest.approx(predict(m).summary.breakdown.compute_s)


def test_refusals(tmp_path: Path) -> None:
    doc, _ = _fake_trace("1f1b", 4)
    m = measure(doc["traceEvents"], doc["autopart"])
    with pytest.raises(AutopartError, match="cannot predict seq1f1b"):
        predict(m, schedule="seq1f1b")
    with pytest.raises(AutopartError, match="'zb-h9' has no generator"):
        predict(m, schedule="zb-h9")
    with pytest.raises(AutopartError, match="version 99, .* re-measure the run"):
        measure(doc["traceEvents"], {**doc["autopart"], "version": 99})
    with pytest.raises(AutopartError, match="malformed"):
        measure(doc["traceEvents"], {"version": VERSION, "plan": {}})
    for field in ("schedule", "virtual_stages", "dp"):
        plan = {k: v for k, v in doc["autopart"]["plan"].items() if k != field}
        with pytest.raises(AutopartError, match=f"malformed.*{field}"):
            measure(doc["traceEvents"], {**doc["autopart"], "plan": plan})
    with pytest.raises(AutopartError, match="rank 2, which the header's ranks do not list"):
        ranks = {r: c for r, c in doc["autopart"]["ranks"].items() if r != "2"}
        measure(doc["traceEvents"], {**doc["autopart"], "ranks": ranks})
    with pytest.raises(AutopartError, match="no trace file"):
        load(tmp_path / "absent.json")
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"traceEvents": doc["traceEvents"]}))
    with pytest.raises(AutopartError, match="not the trace of an autopart run"):
        load(bare)


def test_events_without_args_are_refused(tmp_path: Path) -> None:
    """Only the events' ``args`` say which action each is; names are never parsed back."""
    doc, _ = _fake_trace("1f1b", 4)
    assert all(e["args"]["kind"] == e["cat"] for e in doc["traceEvents"])
    named = [{k: v for k, v in e.items() if k != "args"} for e in doc["traceEvents"]]
    with pytest.raises(AutopartError, match="records no autopart action in its 'args'") as err:
        measure(named, doc["autopart"])
    assert "re-measure" in err.value.hint
    # a version-1 trace (actions only in the names) is refused by its version first
    old = tmp_path / "old.json"
    old.write_text(
        json.dumps({**doc, "traceEvents": named, "autopart": {**doc["autopart"], "version": 1}})
    )
    with pytest.raises(
        AutopartError, match="version 1, this autopart reads version 2 only: re-measure"
    ):
        load(old)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc, span = _fake_trace("1f1b", 4)
    trace = tmp_path / "run.json"
    trace.write_text(json.dumps(doc))
    assert main(["simulate", "--measured", str(trace), "--global-batch", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["microbatches"] == 8 and out["calibrated"] is True
    assert out["measured"]["iteration_s"] == pytest.approx(span + OVERHEAD)
    assert main(["simulate", "--measured", str(trace)]) == 0
    assert "calibrated prediction" in capsys.readouterr().out
    sim = tmp_path / "sim.json"
    assert main(["simulate", "--measured", str(trace), "--trace", str(sim)]) == 0
    assert {e["pid"] for e in json.loads(sim.read_text())["traceEvents"]} == set(range(P))
    for argv, msg in (
        (["--global-batch", "5"], "not a whole number of micro-batches"),
        (["--tp", "2"], "--tp does not go with --measured"),
        (["--schedule", "seq1f1b"], "cannot predict seq1f1b"),
    ):
        assert main(["simulate", "--measured", str(trace), *argv]) == 2
        assert msg in capsys.readouterr().err
    with pytest.raises(
        SystemExit
    ):  # an abbreviated flag is not silently taken for --virtual-stages
        main(["simulate", "--measured", str(trace), "--virtual", "2"])
    assert "unrecognized arguments: --virtual 2" in capsys.readouterr().err
    inter, _ = _fake_trace("interleaved-1f1b", 6, v=2)
    trace.write_text(json.dumps(inter))
    assert main(["simulate", "--measured", str(trace), "--global-batch", "8"]) == 2
    assert "hint: use a multiple of 6 for --global-batch" in capsys.readouterr().err
    assert (
        main(
            [
                "simulate",
                "--layers",
                "2",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--vocab",
                "64",
                "--seq",
                "32",
                "--global-batch",
                "8",
            ]
        )
        == 2
    )
    assert "simulate needs --gpus" in capsys.readouterr().err
