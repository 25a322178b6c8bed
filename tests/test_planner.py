"""The planner: the 1T search completes with fitting plans; its pruning loses nothing."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from rich.console import Console

from autopart.cli import main
from autopart.errors import AutopartError
from autopart.layout import SCHEDULES, Plan
from autopart.planning.cluster import PRESETS
from autopart.planning.planner import (
    NEAR_TIE,
    Ranked,
    _activation_peak,
    _break_near_ties,
    _explain,
    _variants,
    layouts,
    search,
)
from autopart.planning.simulate import (
    SHAPES,
    CostModel,
    GPTShape,
    _actions,
    fast_lower_bound,
    simulate,
    simulate_costs,
)
from autopart.schedule.generators import SPLIT_BACKWARD

A100 = PRESETS["dgx-a100-80gb"]
SMALL = GPTShape(24, 2048, 16, 50304, 2048, name="small")


@pytest.mark.slow  # suite time; benchmarks/plan_1t.py times it
def test_1t_on_3072_gpus() -> None:
    """The timed run is benchmarks/plan_1t.py; here: it completes and every plan fits (the
    five schedules without a split backward, to keep the suite short: the zero-bubble ones add
    half the layouts and rank below these, docs/simulate.md)."""
    con = Console(file=io.StringIO(), width=120)
    unsplit = [s for s in SCHEDULES if s not in SPLIT_BACKWARD]
    result = search(
        SHAPES["megatron-1t"],
        A100,
        3072,
        3072,
        top=5,
        progress=True,
        console=con,
        schedules=unsplit,
    )
    print(
        f"\n1T on 3072 A100s planned in {result.stats['seconds']:.1f} s: "
        f"{result.ranked[0].plan.describe()}, "
        f"{result.ranked[0].summary.tflops_per_gpu:.1f} TFLOP/s per GPU"
    )
    assert "simulating" in con.file.getvalue()  # the progress display ran
    assert len(result.ranked) == 5
    assert_ranked_order(result.ranked)
    for row in result.ranked:
        assert row.summary.fits and row.summary.memory_gb_per_gpu <= 72.0
        assert row.plan.gpus == 3072 and row.reason
        assert row.lower_bound <= row.summary.iteration_s * (1 + 1e-9)
    st = result.stats
    assert st["layouts"] > 1000 and st["simulated"] >= 5
    assert st["too_big"] > 0 and result.rejected


def assert_ranked_order(ranked: list[Ranked]) -> None:
    """Every plan ranks above the slower ones, except a slower one within NEAR_TIE that needs
    less memory."""
    for i, a in enumerate(ranked):
        for b in ranked[i + 1 :]:
            ta, tb = a.summary.iteration_s, b.summary.iteration_s
            if ta > tb:
                assert ta <= tb * (1 + NEAR_TIE)
                assert a.summary.memory_gb_per_gpu <= b.summary.memory_gb_per_gpu


def _row(name: str, seconds: float, gib: float, plan: Plan | None = None) -> Ranked:
    """A ranked plan with only what ordering and explaining read: its time, its memory, a
    breakdown of zeros; ``name`` in its notes (to tell the rows apart)."""
    cats = dict.fromkeys(
        ("compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "optimizer_s", "bubble_s"), 0.0
    )
    plan = plan or Plan.from_batch(8, 1, dp=8)
    base = simulate(SMALL, A100, Plan.from_batch(8, 1, dp=8), record=False).summary
    summary = dataclasses.replace(base, iteration_s=seconds, memory_gb_per_gpu=gib, breakdown=cats)
    return Ranked(plan, summary, 0, notes=[name])


def _names(rows: list[Ranked]) -> list[str]:
    return [r.notes[0] for r in rows]


def test_a_near_tie_ranks_the_plan_with_less_memory_first() -> None:
    """Plans within NEAR_TIE of the fastest of their group go least memory first; a plan just
    beyond it starts a new group, and groups keep their order."""
    rows = [
        _row("a", 1.000, 5.0),
        _row("b", 1.005, 3.0),
        _row("c", 1.0099, 4.0),
        _row("d", 1.0101, 1.0),  # beyond 1 % of a: the next group, though b and c are near it
        _row("e", 1.030, 0.5),
    ]
    assert NEAR_TIE == 0.01
    got = _break_near_ties(rows)
    assert _names(got) == ["b", "c", "a", "d", "e"]
    assert_ranked_order(got)
    _explain(got)
    assert got[0].reason.startswith("a near tie (0.5% behind #3, within 1%): needs 3.00 GiB")
    assert got[2].reason == "0.5% faster than #1 (a near tie), but needs 5.00 GiB against 3.00 GiB"
    assert got[3].reason.startswith("0.5% slower than #1")
    # no tie: the order is the time order, and #1 is "fastest"
    far = [_row("x", 1.0, 9.0), _row("y", 1.02, 1.0)]
    assert _break_near_ties(far) == far
    _explain(far)
    assert far[0].reason.startswith("fastest; 2.0% ahead of #2")
    # equal memory: the schedule with fewer actions a rank (GPipe has no W) first
    zb = Plan.from_batch(8, 4, pp=2, dp=2, schedule="zb-h1")
    gpipe = Plan.from_batch(8, 4, pp=2, dp=2, schedule="gpipe")
    same = _break_near_ties([_row("zb", 0.369, 0.05, zb), _row("gpipe", 0.371, 0.05, gpipe)])
    assert _names(same) == ["gpipe", "zb"]
    _explain(same)
    # rank 0: F, SEND_F, RECV_B, B, DP_REDUCE; ZB-H1 adds the W
    assert "as much memory, 5 actions a rank against 6" in same[0].reason
    assert same[1].reason.endswith("but as much memory, 6 actions a rank against 5")


def test_lower_bound_never_exceeds_the_simulation() -> None:
    """What makes the branch and bound exact: no plan simulates faster than its bound."""
    for sched, v, k in (
        ("gpipe", 1, 1),
        ("1f1b", 1, 1),
        ("interleaved-1f1b", 2, 1),
        ("seq1f1b", 1, 4),
        ("seq1f1b-interleaved", 3, 2),
    ):
        for rc in ("none", "full"):
            st = Plan.from_batch(
                tp=4,
                pp=4,
                dp=4,
                virtual_stages=v,
                micro_batch=2,
                global_batch=128,
                schedule=sched,
                seq_chunks=k,
                recompute=rc,
                sequence_parallel=True,
                distributed_optimizer=rc == "full",
            )
            costs = CostModel(SMALL, A100, st)
            sim = simulate_costs(costs, record=False)
            assert fast_lower_bound(costs) <= sim.summary.iteration_s * (1 + 1e-12)


def test_search_finds_the_brute_force_top() -> None:
    """Simulate every fitting variant of every layout: the planner's top 3 layouts are the top
    3 of the brute force, though it simulates a small part of them."""
    kw = dict(
        schedules=("1f1b", "interleaved-1f1b", "seq1f1b"), micro_batches=(1, 2), seq_chunks=(2, 4)
    )
    result = search(SMALL, A100, 32, 64, top=3, **kw)
    brute: dict[int, float] = {}
    for i, layout in enumerate(layouts(SMALL, A100, 32, 64, **kw)):
        for st in _variants(layout, ("none", "selective", "full"), A100):
            s = simulate(SMALL, A100, st, record=False).summary
            if s.fits:
                brute[i] = min(brute.get(i, float("inf")), s.iteration_s)
    want = sorted(brute.values())[:3]
    got = sorted(r.summary.iteration_s for r in result.ranked)
    assert got == pytest.approx(want, rel=1e-9)
    assert_ranked_order(result.ranked)
    assert result.stats["simulated"] < result.stats["fitting_variants"] / 4


def test_truncated_activation_peak_is_exact() -> None:
    for sched, v, k in (
        ("1f1b", 1, 1),
        ("interleaved-1f1b", 2, 1),
        ("seq1f1b", 1, 3),
        ("seq1f1b-interleaved", 2, 2),
        ("gpipe", 1, 1),
    ):
        st = Plan.from_batch(
            tp=2,
            pp=4,
            dp=2,
            virtual_stages=v,
            global_batch=2 * 4 * 9,
            schedule=sched,
            seq_chunks=k,
            recompute="full",
        )
        costs = CostModel(SMALL, A100, st)
        acts = _actions(sched, 4, st.microbatches, v, k, True, True)
        for r in range(4):
            assert _activation_peak(costs, r) == pytest.approx(costs.activation_peak(acts[r]))


def test_layouts_respect_the_constraints() -> None:
    found = layouts(SHAPES["megatron-1t"], A100, 3072, 3072)
    assert found
    for lay in found:
        assert lay["tp"] * lay["pp"] * lay["dp"] == 3072 and lay["tp"] <= 8
        m = 3072 // (lay["dp"] * lay["micro_batch"])
        if "interleaved" in lay["schedule"]:
            assert m % lay["pp"] == 0 and 128 % (lay["pp"] * lay["virtual_stages"]) == 0
        assert (lay["seq_chunks"] > 1) == lay["schedule"].startswith("seq1f1b")


def test_layouts_replicate_too_few_kv_heads() -> None:
    """A model with 2 KV heads on 8-GPU nodes: tp = 4 and 8 are candidates (the heads are
    replicated); 10 KV heads rule out tp = 4 and 8 (neither divisor nor multiple) but keep 2."""
    gqa = dataclasses.replace(SHAPES["megatron-1t"], kv_heads=2)
    assert {lay["tp"] for lay in layouts(gqa, A100, 64, 64)} >= {1, 2, 4, 8}
    ten = dataclasses.replace(SHAPES["megatron-1t"], kv_heads=10)
    assert {lay["tp"] for lay in layouts(ten, A100, 64, 64)} == {1, 2}


def test_nothing_fits() -> None:
    with pytest.raises(AutopartError, match="no plan") as err:
        search(SHAPES["megatron-1t"], A100, 8, 8)
    assert "more GPUs" in str(err.value)


def test_cli_plan_json(capsys) -> None:
    code = main(
        [
            "plan",
            "--layers",
            "8",
            "--hidden",
            "1024",
            "--heads",
            "16",
            "--vocab",
            "32000",
            "--seq",
            "1024",
            "--gpus",
            "16",
            "--global-batch",
            "64",
            "--top",
            "3",
            "--json",
            "--no-progress",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["plans"]) == 3 and out["stats"]["layouts"] > 0
    first = out["plans"][0]
    for key in (
        "plan",
        "reason",
        "iteration_s",
        "tokens_per_s",
        "tflops_per_gpu",
        "mfu",
        "bubble_fraction",
        "memory_gb_per_gpu",
        "breakdown",
    ):
        assert key in first
    assert first["reason"].startswith("fastest")
