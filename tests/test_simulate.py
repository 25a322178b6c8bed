"""The simulator: closed-form bubbles, the event rules, clusters, memory, FLOPs, a Megatron point."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import pytest

from autopart.cli import main
from autopart.errors import AutopartError
from autopart.layout import Plan
from autopart.planning.cluster import GIB, PRESETS, Cluster, load_cluster
from autopart.planning.simulate import (
    SHAPES,
    CostModel,
    GPTShape,
    shape_from_captured,
    simulate,
    simulate_actions,
    to_chrome_trace,
)
from autopart.schedule import Action, generate

A100 = PRESETS["dgx-a100-80gb"]
UNFUSED = replace(A100, attention="unfused")  # Megatron's 2021 attention kernels


def pipeline(name: str, p: int, m: int, v: int = 1, k: int = 1, **kw) -> dict[int, list[Action]]:
    return {r: generate(name, r, m, list(range(p)), v=v, k=k, **kw) for r in range(p)}


def equal_costs(f: float = 1.0, b: float = 2.0):
    return lambda a: {"F": f, "B": b}.get(a.kind, 0.0)


# -- closed forms: equal per-action costs, free communication ---------------------------------
#
# With every F costing f and every B costing b on every stage (and free transfers), rank r is
# busy m·v·k·(f + b) and the iteration lasts that plus (p − 1) "slots" of one unit's f + b,
# so the bubble (idle / iteration, the same on every rank) is (p − 1)/(m·v·k + p − 1):
# GPipe and 1F1B (v = k = 1), interleaved 1F1B ((p − 1)/v micro-batch slots), Seq1F1B ((p − 1)/k),
# and Seq1F1B interleaved. Checked here for B = 2F and B = F.


def closed_form(p: int, m: int, v: int = 1, k: int = 1) -> float:
    return (p - 1) / (m * v * k + p - 1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
def test_gpipe_and_1f1b_bubble(name: str, p: int, m: int) -> None:
    for f, b in ((1.0, 2.0), (1.0, 1.0)):
        tl = simulate_actions(pipeline(name, p, m), equal_costs(f, b))
        assert tl.bubble_fraction == pytest.approx(closed_form(p, m), abs=1e-12)
        assert tl.span == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (4, 4), (4, 8), (3, 9)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble(p: int, m: int, v: int) -> None:
    tl = simulate_actions(pipeline("interleaved-1f1b", p, m, v=v), equal_costs())
    assert tl.bubble_fraction == pytest.approx(closed_form(p, m, v=v), abs=1e-12)
    # in micro-batch slots: (p − 1)/v of one micro-batch's forward + backward on a rank
    per_mb = v * 3.0
    assert tl.span - m * per_mb == pytest.approx((p - 1) / v * per_mb)


@pytest.mark.parametrize("p", [2, 4, 5])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_seq1f1b_bubble(p: int, m: int, k: int) -> None:
    tl = simulate_actions(pipeline("seq1f1b", p, m, k=k), equal_costs())
    assert tl.bubble_fraction == pytest.approx(closed_form(p, m, k=k), abs=1e-12)


@pytest.mark.parametrize("p,m,v,k", [(2, 4, 2, 2), (4, 4, 2, 3), (3, 6, 3, 2), (4, 8, 2, 4)])
def test_seq1f1b_interleaved_bubble(p: int, m: int, v: int, k: int) -> None:
    tl = simulate_actions(pipeline("seq1f1b-interleaved", p, m, v=v, k=k), equal_costs())
    assert tl.bubble_fraction == pytest.approx(closed_form(p, m, v=v, k=k), abs=1e-12)


# -- the event rules ---------------------------------------------------------------------------


def test_transfers_delay_receives_and_are_counted() -> None:
    acts = pipeline("1f1b", 2, 4)
    free = simulate_actions(acts, equal_costs())
    slow = simulate_actions(acts, equal_costs(), comm_fn=lambda a: 0.5)
    assert slow.span > free.span
    assert slow.ranks[1].recv_exposed > 0 and slow.ranks[1].recv_exposed <= slow.ranks[1].recv_wait
    # a send never blocks its sender: rank 0's first two forwards run back to back
    f0 = [e for e in slow.events if e.rank == 0 and e.kind == "F"]
    assert f0[1].start == pytest.approx(f0[0].end)


def test_dp_reduce_overlaps_the_last_backward() -> None:
    acts = pipeline("1f1b", 1, 3, dp=2)
    for reduce_s, wait in ((1.5, 0.0), (5.0, 3.0)):  # the last B runs 7..9 and starts the reduce
        costs = {"F": 1.0, "B": 2.0, "DP_REDUCE": reduce_s}
        tl = simulate_actions(acts, lambda a, c=costs: c.get(a.kind, 0.0))
        assert tl.ranks[0].dp_wait == pytest.approx(wait)
        assert tl.span == pytest.approx(9.0 + wait)


def test_tie_reduce_meets_both_ends() -> None:
    acts = {r: generate("1f1b", r, 2, [0, 1], tied=r in (0, 1)) for r in range(2)}
    tl = simulate_actions(acts, lambda a: {"F": 1.0, "B": 2.0, "TIE_REDUCE": 0.25}.get(a.kind, 0))
    ties = [e for e in tl.events if e.kind == "TIE_REDUCE"]
    assert len(ties) == 2 and ties[0].end == ties[1].end == pytest.approx(tl.span)


def test_deadlock_is_refused() -> None:
    acts = {
        0: [Action("RECV_B", 0, 0, peer=1), Action("SEND_F", 0, 0, peer=1)],
        1: [Action("RECV_F", 1, 0, peer=0), Action("SEND_B", 1, 0, peer=0)],
    }
    with pytest.raises(AutopartError, match="deadlocks"):
        simulate_actions(acts, equal_costs())


def test_chrome_trace_format() -> None:
    acts = pipeline("seq1f1b", 2, 2, k=2)
    tl = simulate_actions(acts, equal_costs(1e-3, 2e-3))
    trace = to_chrome_trace(tl.events)
    assert len(trace) == sum(len(a) for a in acts.values())  # one event per action
    ev = next(e for e in trace if e["name"] == "F(s0,m1,c1)")
    assert set(ev) == {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"}
    assert ev["args"] == {"kind": "F", "stage": 0, "mb": 1, "chunk": 1, "peer": None}
    assert ev["cat"] == "F" and ev["ph"] == "X" and ev["pid"] == 0 and ev["tid"] == 0
    assert ev["dur"] == pytest.approx(1e3)  # µs


# -- clusters ---------------------------------------------------------------------------------


def test_presets() -> None:
    a100, h100 = load_cluster("dgx-a100-80gb"), load_cluster("dgx-h100")
    assert (a100.peak_tflops, a100.hbm_tbps, a100.nvlink_gbps) == (312, 2.0, 300)
    assert a100.gpus_per_node == 8
    assert a100.ib_gbps_per_gpu == 25.0  # 8 × 200 Gb/s per node, one NIC per GPU
    assert (h100.peak_tflops, h100.hbm_tbps, h100.nvlink_gbps) == (989, 3.35, 450)
    assert h100.ib_gbps_per_gpu == 50.0
    with pytest.raises(AutopartError, match="did you mean 'dgx-a100-80gb'"):
        load_cluster("dgx-a100")


def test_cluster_files(tmp_path) -> None:
    toml = tmp_path / "mine.toml"
    toml.write_text('base = "dgx-h100"\nmm_efficiency = 0.5\ngpus_per_node = 4\n')
    c = load_cluster(toml)
    assert c.name == "mine" and c.mm_efficiency == 0.5 and c.peak_tflops == 989
    js = tmp_path / "full.json"
    js.write_text(json.dumps({**A100.to_json(), "name": "copy"}))
    assert load_cluster(js) == Cluster(**{**A100.to_json(), "name": "copy"})
    bad = tmp_path / "bad.toml"
    bad.write_text('base = "dgx-h100"\npeak_tflop = 1\n')
    with pytest.raises(AutopartError, match="did you mean 'peak_tflops'"):
        load_cluster(bad)
    (tmp_path / "part.toml").write_text('name = "x"\npeak_tflops = 1\n')
    with pytest.raises(AutopartError, match="missing"):
        load_cluster(tmp_path / "part.toml")
    # a 5000-digit integer (Python refuses past 4300 digits) and deep nesting: raw errors before
    (tmp_path / "long.json").write_text('{"gpus_per_node": ' + "9" * 5000 + "}")
    (tmp_path / "deep.toml").write_text("a = " + "[" * 50000 + "]" * 50000)
    for name in ("long.json", "deep.toml"):
        with pytest.raises(AutopartError, match="cannot read cluster file"):
            load_cluster(tmp_path / name)


def test_tp_inside_a_node_uses_nvlink_across_nodes_infiniband() -> None:
    shape = SHAPES["gpt3-175b"]
    costs = {
        t: CostModel(shape, A100, Plan.from_batch(tp=t, pp=8, dp=1, global_batch=8))
        for t in (8, 16)
    }
    assert A100.link(8)[0] == "nvlink" and A100.link(16)[0] == "ib"
    tp8, tp16 = costs[8].units[1][0].f_tp, costs[16].units[1][0].f_tp
    # same bytes per ring step nearly; NVLink 240 GB/s effective, against the 8 NICs a node's
    # 8 members pool over InfiniBand (8 × 21 GB/s) plus the longer latency
    assert tp16 / tp8 > 1.4
    # a group with one member per node (a dp group across tp=8 nodes) has one NIC: 8× slower
    assert A100.link(16, 8)[1] * 8 == pytest.approx(A100.link(16, 1)[1])


def test_tp_exchange_counts_one_latency_step_per_collective() -> None:
    """autopart's gloo groups exchange directly (``tp_exchange``): one latency step per
    collective, so a layer's four SP collectives pay twice the latency of its two all-reduces
    without SP; a ring pays the same for both (2(t − 1) steps per all-reduce)."""
    shape = SHAPES["gpt3-175b"]
    # latency-bound: 1 ms a step, bytes at next to no cost
    slow = replace(A100, nvlink_latency_us=1000.0, nvlink_gbps=1e9)

    def f_tp(cl: Cluster, sp: bool, t: int = 2) -> float:
        plan = Plan.from_batch(tp=t, pp=8, dp=1, global_batch=8, sequence_parallel=sp)
        return CostModel(shape, cl, plan).units[1][0].f_tp

    layers = CostModel(shape, A100, Plan.from_batch(tp=2, pp=8, global_batch=8)).layers[1]
    ring, exchange = slow, replace(slow, tp_exchange=True)
    # t = 2: a ring's all-reduce is 2 steps, its all-gather / reduce-scatter 1; 4 per layer both
    assert f_tp(ring, True) == pytest.approx(f_tp(ring, False), rel=0.01)
    assert f_tp(ring, False) == pytest.approx(layers * 4e-3, rel=0.01)
    assert f_tp(exchange, True) == pytest.approx(layers * 4e-3, rel=0.01)
    assert f_tp(exchange, False) == pytest.approx(layers * 2e-3, rel=0.01)
    # t = 4: a ring all-reduce takes 6 steps, the exchange 1
    assert f_tp(ring, False, 4) == pytest.approx(layers * 12e-3, rel=0.01)
    assert f_tp(exchange, False, 4) == pytest.approx(layers * 2e-3, rel=0.01)
    # the bytes: an exchange all-reduce moves (t − 1) × the tensor, a ring 2(t − 1)/t ×
    fast = replace(A100, nvlink_latency_us=1e-6)
    assert f_tp(replace(fast, tp_exchange=True), False, 4) == pytest.approx(
        2 * f_tp(fast, False, 4), rel=0.01
    )


def test_pipeline_hops_between_nodes_use_infiniband() -> None:
    costs = CostModel(SHAPES["gpt3-175b"], A100, Plan.from_batch(tp=2, pp=8, dp=1, global_batch=8))
    assert costs.p2p_link(0, 1)[0] == "nvlink"  # ranks 0-1 and 2-3: one node
    assert costs.p2p_link(3, 4)[0] == "ib"  # ranks 6-7 and 8-9: two nodes


# -- memory -----------------------------------------------------------------------------------


def test_distributed_optimizer_divides_the_optimizer_state_by_dp() -> None:
    shape = SHAPES["gpt3-175b"]
    base = dict(tp=8, pp=8, dp=16, global_batch=128)
    plain = CostModel(shape, A100, Plan.from_batch(**base)).static_bytes(0)
    dist = CostModel(shape, A100, Plan.from_batch(**base, distributed_optimizer=True)).static_bytes(
        0
    )
    assert dist["optimizer"] == pytest.approx(plain["optimizer"] / 16)
    assert dist["parameters"] == plain["parameters"] and dist["gradients"] == plain["gradients"]
    # 18 bytes per parameter, Megatron's mixed-precision Adam (bf16 weights, fp32 gradients)
    params = CostModel(shape, A100, Plan.from_batch(**base)).params[0]
    assert sum(plain.values()) == pytest.approx(18 * params)


def test_parameters_add_up_to_the_model() -> None:
    shape = SHAPES["megatron-1t"]
    costs = CostModel(shape, A100, Plan.from_batch(tp=1, pp=4, dp=1, global_batch=4))
    tied_copy = shape.vocab * shape.hidden  # the last stage's copy of the embedding
    assert sum(costs.params) == pytest.approx(shape.params + tied_copy)
    assert shape.params == pytest.approx(1.008e12, rel=1e-3)  # as benchmarks/capture_1t.py counts


def test_replicated_kv_heads_stay_whole_on_every_rank() -> None:
    """At tp = 8, 1 or 2 KV heads are replicated (as ``tensor_parallel`` does): each GPU holds
    K/V's weights and biases whole, so one more KV head costs every GPU all of its
    2·(h + 1)·d parameters a layer, where with 8 or 16 heads (split) it costs an eighth; the
    replicated weights' gradient all-reduce lengthens the backward's tp time."""
    plan = Plan.from_batch(tp=8, pp=1, dp=1, global_batch=8)
    shape = GPTShape(layers=8, hidden=4096, heads=32, vocab=32000, seq=4096, kv_heads=1)
    h, d = shape.hidden, shape.head_dim

    def params(kv: int) -> float:
        return CostModel(replace(shape, kv_heads=kv), A100, plan).params[0]

    assert params(2) - params(1) == pytest.approx(8 * 2 * (h + 1) * d)
    assert params(16) - params(8) == pytest.approx(8 * 2 * (h + 1) * 8 * d / 8)
    with pytest.raises(AutopartError, match="neither divides the kv heads"):
        CostModel(replace(shape, hidden=6144, heads=48, kv_heads=12), A100, plan)


def test_activation_savers_save_memory() -> None:
    shape = SHAPES["gpt3-175b"]
    mem = {}
    for rc in ("none", "selective", "full"):
        for sp in (False, True):
            st = Plan.from_batch(
                tp=8,
                pp=8,
                dp=1,
                global_batch=16,
                recompute=rc,
                sequence_parallel=sp,
            )
            mem[rc, sp] = simulate(shape, UNFUSED, st).summary.memory.activations
    assert mem["none", False] > mem["selective", False] > mem["full", False]
    assert mem["selective", True] < mem["selective", False]
    # a flash kernel stores no scores: no recompute keeps what selective keeps
    flash = {
        rc: simulate(
            shape, A100, Plan.from_batch(tp=8, pp=8, global_batch=16, recompute=rc)
        ).summary.memory.activations
        for rc in ("none", "selective")
    }
    assert flash["none"] == flash["selective"] == mem["selective", False]
    # Korthikanti et al. 2022: 34·s·b·h + 5·a·s²·b bytes per layer without parallelism → with tp = 8
    # and SP everything / 8, so "selective + SP" keeps 34/8·s·b·h per layer
    st = Plan.from_batch(
        tp=8, pp=8, dp=1, global_batch=16, recompute="selective", sequence_parallel=True
    )
    unit = CostModel(shape, A100, st).units[1][0]  # a middle stage: 12 layers, no embedding/head
    assert unit.act == pytest.approx(12 * 34 * 2048 * shape.hidden / 8)


def test_1f1b_holds_fewer_micro_batches_than_gpipe() -> None:
    shape = SHAPES["gpt-7b"]
    act = {
        s: simulate(
            shape, A100, Plan.from_batch(pp=4, dp=2, global_batch=32, schedule=s)
        ).summary.memory.activations
        for s in ("gpipe", "1f1b")
    }
    assert act["gpipe"] > 3 * act["1f1b"]  # 16 micro-batches in flight on rank 0 against 4


# -- FLOPs and the Megatron reference point ------------------------------------------------------


def test_flops_follow_megatrons_formula() -> None:
    shape = SHAPES["megatron-1t"]
    B, s, n, h, V = 3072, 2048, 128, 25600, 51200  # n: layers (l in the paper)
    full = CostModel(
        shape, A100, Plan.from_batch(tp=8, pp=64, dp=6, global_batch=B, recompute="full")
    )
    with_recompute = 96 * B * s * n * h * h * (1 + s / (6 * h) + V / (16 * n * h))
    without = 72 * B * s * n * h * h * (1 + s / (6 * h) + V / (12 * n * h))
    assert full.hardware_flops() == pytest.approx(with_recompute)
    assert full.model_flops() == pytest.approx(without)


def test_extrapolation_matches_the_full_simulation() -> None:
    shape = SHAPES["gpt3-175b"]
    for sched, v, k in (
        ("1f1b", 1, 1),
        ("interleaved-1f1b", 2, 1),
        ("seq1f1b", 1, 4),
        ("seq1f1b-interleaved", 2, 2),
    ):
        st = Plan.from_batch(
            tp=8,
            pp=4,
            dp=8,
            virtual_stages=v,
            global_batch=8 * 4 * 7,
            schedule=sched,
            seq_chunks=k,
            recompute="selective",
            sequence_parallel=True,
            distributed_optimizer=True,
        )
        full = simulate(shape, A100, st, extrapolate=False, record=False).summary
        ext = simulate(shape, A100, st, extrapolate=True).summary
        assert ext.extrapolated and not full.extrapolated
        assert ext.iteration_s == pytest.approx(full.iteration_s, rel=1e-9)
        assert ext.memory_gb_per_gpu == pytest.approx(full.memory_gb_per_gpu, rel=1e-9)
        for key, val in full.breakdown.items():
            assert ext.breakdown[key] == pytest.approx(val, rel=1e-9, abs=1e-12)


def test_seq1f1b_chunks_are_balanced_by_work() -> None:
    """Chunks balanced for FLOPs (autopart.schedule.chunks) are close in simulated time too, not equal:
    the attention kernel runs at a lower share of peak than the GEMMs (docs/simulate.md)."""
    shape = GPTShape(32, 4096, 32, 50304, 32768)
    ratio = {}
    for split in ("balanced", "uniform"):
        st = Plan.from_batch(
            pp=4, global_batch=4, schedule="seq1f1b", seq_chunks=4, seq_split=split
        )
        costs = CostModel(shape, A100, st)
        assert sum(costs.chunk_lengths) == 32768
        times = [u.f + u.b for u in costs.units[1]]
        ratio[split] = max(times) / min(times)
        if split == "balanced":
            assert list(costs.chunk_lengths) == sorted(costs.chunk_lengths, reverse=True)
    assert ratio["balanced"] < 1.25 and ratio["uniform"] > 2.0


def test_refusals() -> None:
    shape = SHAPES["gpt3-175b"]
    with pytest.raises(AutopartError, match="divisible by dp"):
        simulate(shape, A100, Plan.from_batch(dp=3, global_batch=16))
    with pytest.raises(AutopartError, match="did you mean 'interleaved-1f1b'"):
        simulate(shape, A100, Plan.from_batch(pp=2, schedule="interleaved-1fb", global_batch=4))
    with pytest.raises(AutopartError, match="does not divide the heads"):
        simulate(shape, A100, Plan.from_batch(tp=5, global_batch=4))
    with pytest.raises(AutopartError, match="unknown cluster"):
        simulate(shape, "dgx-b200", Plan.from_batch(global_batch=4))


# -- shapes from a captured model and the command line ------------------------------------------


def test_shape_from_captured(gpt_sdpa) -> None:
    shape = shape_from_captured(gpt_sdpa.captured)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv, shape.ffn_width, shape.vocab) == (
        2,
        32,
        4,
        4,
        128,
        96,
    )
    assert shape.tied and shape.seq == gpt_sdpa.captured.example_shape[1]
    params = sum(t.numel() for t in gpt_sdpa.captured.params.values())
    positions = gpt_sdpa.captured.params["transformer.wpe.weight"].numel()  # block_size rows
    assert shape.params - shape.seq * shape.hidden == params - positions


def test_cli_simulate_json(capsys, tmp_path) -> None:
    trace = tmp_path / "sim.json"
    code = main(
        [
            "simulate",
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
            "--tp",
            "2",
            "--pp",
            "4",
            "--global-batch",
            "32",
            "--schedule",
            "seq1f1b",
            "--seq-chunks",
            "2",
            "--json",
            "--trace",
            str(trace),
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "iteration_s",
        "tokens_per_s",
        "tflops_per_gpu",
        "mfu",
        "bubble_fraction",
        "memory_gb_per_gpu",
        "breakdown",
    ):
        assert key in out
    assert math.isclose(out["tokens_per_s"], 32 * 1024 / out["iteration_s"])
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert (
        main(
            ["simulate", "--shape", "gpt3-175b", "--gpus", "12", "--tp", "8", "--global-batch", "8"]
        )
        == 2
    )
    assert "not divisible" in capsys.readouterr().err


def test_memory_units_are_gib() -> None:
    s = simulate(SHAPES["gpt-7b"], A100, Plan.from_batch(tp=8, global_batch=8)).summary
    assert s.memory.capacity == 80 and s.memory.usable == pytest.approx(72)
    m = s.memory
    total = m.parameters + m.gradients + m.optimizer + m.activations
    assert s.memory_gb_per_gpu == pytest.approx(total)
    assert s.memory.parameters * GIB == pytest.approx(
        2 * CostModel(SHAPES["gpt-7b"], A100, Plan.from_batch(tp=8, global_batch=8)).params[0]
    )


def test_cli_refuses_a_plan_that_does_not_fit(capsys) -> None:
    """By how much, and which plans one change away fit (each checked to fit)."""
    argv = [
        "simulate",
        "--shape",
        "megatron-1t",
        "--gpus",
        "3072",
        "--tp",
        "8",
        "--pp",
        "64",
        "--virtual-stages",
        "2",
        "--schedule",
        "interleaved-1f1b",
        "--global-batch",
        "768",
        "--attention",
        "unfused",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not fit: rank 0 needs 238.7 GiB" in err and "166.7 GiB over the 72.0 usable" in err
    assert "these fit: tp=8 pp=64 dp=6 v=2 b=1 m=128 interleaved-1f1b recompute=full" in err
    assert main([*argv, "--recompute", "full", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"]
    assert main([*argv, "--ignore-memory", "--json"]) == 0
    assert not json.loads(capsys.readouterr().out)["fits"]
    assert (
        main(
            ["simulate", "--shape", "gpt3-175b", "--gpus", "8", "--tp", "8", "--global-batch", "8"]
        )
        == 2
    )
    assert "hint: no single change of layout fits; more GPUs" in capsys.readouterr().err


def test_fitting_alternatives_fit() -> None:
    from autopart.planning.planner import fitting_alternatives, memory_need

    st = Plan.from_batch(tp=8, pp=16, dp=8, global_batch=512, micro_batch=4)
    shape = SHAPES["gpt3-175b"]
    assert memory_need(shape, A100, st) > A100.usable_bytes
    alts = fitting_alternatives(shape, A100, st, limit=10)
    assert alts, "a memory saver must fit 175B on 1024 GPUs"
    for alt, need in alts:
        assert need <= A100.usable_bytes
        assert simulate(SHAPES["gpt3-175b"], A100, alt, record=False).summary.fits


# -- a speed model: ranks computing at once slow each other --------------------------------


@dataclass(frozen=True)
class Slowed:
    """A speed model for the tests: each of several processes computing at once on a node
    takes ``1 + by`` times as long as alone (``benchmarks/shared_cores.py`` is the real one)."""

    by: float

    def crowding(self, processes: float) -> float:
        return 1.0 + self.by if processes > 1 else 1.0


@pytest.mark.parametrize(
    "name,p,m,v,k,kw",
    [
        ("1f1b", 4, 6, 1, 1, dict(dp=2)),
        ("gpipe", 3, 4, 1, 1, {}),
        ("interleaved-1f1b", 2, 4, 2, 1, {}),
        ("seq1f1b", 4, 4, 1, 3, {}),
        ("zb-h1", 3, 6, 1, 1, dict(dp=2)),
    ],
)
@pytest.mark.parametrize("fill", [False, True])
def test_a_vanishing_slowdown_is_the_dedicated_simulation(name, p, m, v, k, kw, fill) -> None:
    """The event loop in global time order (a speed model that can slow ranks) gives the
    timeline of ranks on devices of their own (which run on by themselves) as its slowdown
    vanishes, event by event."""
    acts = {
        r: generate(name, r, m, list(range(p)), v=v, k=k, tied=r in (0, p - 1), **kw)
        for r in range(p)
    }

    def cost(a: Action) -> float:  # unequal per stage and chunk, so timing matters
        base = {"F": 1.0, "B": 2.1, "W": 0.8, "DP_REDUCE": 1.7, "TIE_REDUCE": 0.3}
        return base.get(a.kind, 0.0) * (1 + 0.1 * a.stage + 0.05 * a.chunk)

    plain = simulate_actions(acts, cost, lambda a: 0.2, fill_waits=fill)
    slowed = simulate_actions(acts, cost, lambda a: 0.2, fill_waits=fill, speed=Slowed(1e-12))
    assert slowed.span > plain.span
    assert slowed.span == pytest.approx(plain.span, rel=1e-9)
    assert [(e.rank, e.action, e.start, e.end) for e in slowed.events] == [
        (e.rank, e.action, pytest.approx(e.start), pytest.approx(e.end)) for e in plain.events
    ]


def test_a_speed_model_slows_a_node_s_ranks_and_the_optimizer() -> None:
    """dp=4 on one node of 4: the pipeline rank stands for 4 processes, each slowed by the
    speed model whenever it computes, and so is the optimizer step; a rank alone on its node
    never is."""
    shape = GPTShape(layers=4, hidden=256, heads=8, seq=256, vocab=512)
    cpu = replace(A100, gpus_per_node=4)
    plan = Plan.from_batch(8, micro_batch=1, dp=4)
    alone, slow = simulate(shape, cpu, plan), simulate(shape, cpu, plan, speed=Slowed(0.25))
    assert slow.timeline.ranks[0].busy == pytest.approx(1.25 * alone.timeline.ranks[0].busy)
    assert slow.costs.optimizer_time(0) == pytest.approx(1.25 * alone.costs.optimizer_time(0))
    one = replace(cpu, gpus_per_node=1)
    single = Plan.from_batch(8, micro_batch=1)
    assert simulate(shape, one, single, speed=Slowed(0.25)).summary.iteration_s == (
        simulate(shape, one, single).summary.iteration_s
    )


# -- zero-bubble schedules: the bubble of a split backward ------------------------------------


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.2, 0.8)])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(p, m, f, b, w) -> None:
    """ZB-H1's closed form (Qi et al. 2024): idle (p − 1)(F + B − W) per rank, against
    1F1B's (p − 1)(F + B + W) with the same work unsplit; a third when all three are equal."""
    costs = {"F": f, "B": b, "W": w}
    zb = simulate_actions(pipeline("zb-h1", p, m), lambda a: costs.get(a.kind, 0.0))
    assert zb.span - m * (f + b + w) == pytest.approx((p - 1) * (f + b - w))
    one = simulate_actions(pipeline("1f1b", p, m), equal_costs(f, b + w))
    assert one.span - m * (f + b + w) == pytest.approx((p - 1) * (f + b + w))
    if f == b == w:  # idle a third; as a fraction of the (shorter) span ≤ 0.4 once m ≥ 3(p − 1)
        assert (zb.bubble_fraction <= 0.4 * one.bubble_fraction) == (m >= 3 * (p - 1))


@pytest.mark.parametrize("p,m,k", [(2, 4, 2), (4, 8, 2), (4, 8, 4)])
def test_seq1f1b_zb_bubble_is_a_third_of_seq1f1b(p, m, k) -> None:
    zb = simulate_actions(
        pipeline("seq1f1b-zb", p, m, k=k), lambda a: {"F": 1.0, "B": 1.0, "W": 1.0}.get(a.kind, 0.0)
    )
    seq = simulate_actions(pipeline("seq1f1b", p, m, k=k), equal_costs(1.0, 2.0))
    assert zb.span - 3 * m * k == pytest.approx(p - 1)
    assert seq.span - 3 * m * k == pytest.approx(3 * (p - 1))


def test_simulated_zb_h1_splits_the_backward_and_beats_1f1b() -> None:
    shape = GPTShape(layers=8, hidden=1024, heads=16, seq=2048, vocab=51200)
    base = dict(micro_batch=1, pp=4)
    one = simulate(shape, A100, Plan.from_batch(32, schedule="1f1b", **base))
    zb = simulate(shape, A100, Plan.from_batch(32, schedule="zb-h1", **base))
    w = sum(e.end - e.start for e in zb.events if e.kind == "W" and e.rank == 0)
    b_zb = sum(e.end - e.start for e in zb.events if e.kind in ("B", "W") and e.rank == 0)
    b_one = sum(e.end - e.start for e in one.events if e.kind == "B" and e.rank == 0)
    assert 0.2 * b_one < w < 0.6 * b_one  # the weight GEMMs: about half the backward
    assert b_zb == pytest.approx(b_one)  # split, not more work
    assert zb.summary.iteration_s < one.summary.iteration_s
    # a split backward frees a unit at its W: held longer, never less than 1F1B's
    assert zb.summary.memory.activations >= one.summary.memory.activations


def test_a_cpu_gemm_reads_its_weight_each_call_and_a_deferred_w_its_operands() -> None:
    """With ``mm_weight_gbps`` (a CPU profile) each forward and input-gradient GEMM reads its
    weight once more (the weight-gradient GEMM writes it), and a deferred W reads each GEMM's
    input and output gradient back; without it (GPUs) neither costs anything."""
    from autopart.planning.simulate.performance import CostModel, _layer

    shape = GPTShape(layers=2, hidden=256, heads=8, seq=256, vocab=512)
    h, f, tp, tokens, gbps = 256, 1024, 2, 2 * 64, 10.0
    cold = replace(A100, mm_weight_gbps=gbps)
    args = (shape, tp, False, "none", "flash", 2, 64, 64)
    base, got = _layer(shape, A100, *args[1:]), _layer(shape, cold, *args[1:])
    weights = (h * 3 * h + h * h + h * f + f * h) / tp  # QKV, projection, fc1, fc2 per rank
    per_call = A100.act_bytes * weights / (gbps * 1e9)
    assert got.f - base.f == pytest.approx(per_call)
    assert got.b - base.b == pytest.approx(per_call)
    assert got.w == pytest.approx(base.w) and base.w_cold == 0.0
    read_back = tokens * (h + 3 * h / tp + h / tp + h + h + f / tp + f / tp + h)
    assert got.w_cold == pytest.approx(A100.act_bytes * read_back / (gbps * 1e9))
    plan = Plan.from_batch(8, micro_batch=2, pp=2, schedule="zb-h1")
    costs = CostModel(shape, cold, plan)
    u = costs.units[1][0]
    assert costs.action_cost(Action("W", 1, 0)) == pytest.approx(u.w + u.w_cold)
    assert costs.action_cost(Action("B", 1, 0)) == pytest.approx(u.b + u.b_tp - u.w)


@pytest.mark.parametrize("name,k", [("zb-h1", 1), ("seq1f1b-zb", 2)])
@pytest.mark.parametrize("slowdown", [0.0, 1.0, 0.5])
def test_a_waiting_rank_fills_its_wait_with_deferred_w(name: str, k: int, slowdown: float) -> None:
    """``fill_waits``: a rank waiting for a receive runs pieces of the W's whose B has run:
    they come after that B, nothing on a rank overlaps, and some W's run in pieces. On devices
    of their own (no slowdown) each W's pieces add up to its cost, the work is the same, the
    iteration no longer, and the last rank, which waits for the slower stage 0, ends sooner;
    where ranks slow each other, a filling rank slows the others as any computing rank does."""
    p, m = 3, 6
    acts = pipeline(name, p, m, k=k)

    def cost(a: Action) -> float:
        return {"F": 1.0, "B": 1.0, "W": 0.8}.get(a.kind, 0.0) * (1.6 if a.stage == 0 else 1.0)

    speed = Slowed(slowdown)
    plain = simulate_actions(acts, cost, lambda a: 0.1, speed=speed)
    filled = simulate_actions(acts, cost, lambda a: 0.1, speed=speed, fill_waits=True)
    if not slowdown:
        assert filled.span <= plain.span + 1e-9
        assert filled.ranks[p - 1].end < plain.ranks[p - 1].end
    for r in range(p):
        if not slowdown:  # slowed, busy is wall time, which the slowdown stretches
            assert filled.ranks[r].busy == pytest.approx(plain.ranks[r].busy)
        events = [e for e in filled.events if e.rank == r]
        for a, b in zip(events, events[1:], strict=False):
            assert a.end <= b.start + 1e-9, (a, b)
        pieces: dict[Action, float] = {}
        for e in events:
            if e.kind == "W":
                pieces[e.action] = pieces.get(e.action, 0.0) + e.end - e.start
        if not slowdown:  # an event's span is its cost
            assert all(t == pytest.approx(cost(a)) for a, t in pieces.items())
        # a W's pieces come after its B (the unit's weight gradients are ready then)
        b_end = {
            (e.action.stage, e.action.mb, e.action.chunk): e.end for e in events if e.kind == "B"
        }
        assert all(
            e.start >= b_end[(e.action.stage, e.action.mb, e.action.chunk)] - 1e-9
            for e in events
            if e.kind == "W"
        )
    last = [e for e in filled.events if e.rank == p - 1]
    assert sum(e.kind == "W" for e in last) > m * k  # some W ran in pieces while waiting


def test_an_unknown_flag_is_named_by_the_subcommand(capsys) -> None:
    """``--virtual`` (not ``--virtual-stages``) printed the top-level usage, ``autopart [-h]
    COMMAND ...``; it is the subcommand's parser that names it now."""
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "simulate",
                "--shape",
                "gpt-7b",
                "--gpus",
                "8",
                "--global-batch",
                "8",
                "--virtual",
                "2",
            ]
        )
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "usage: autopart simulate" in err
    assert "autopart simulate: error: unrecognized arguments: --virtual 2" in err
