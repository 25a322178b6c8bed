"""Zero-bubble schedules at run time: the runner's W actions.

On one rank: B leaves the GEMM weights' gradients to W and the step still equals 1F1B's (float64,
and bf16 through the master's cast); the trace and timeline show W. The pass's invariant:
tests/passes/test_weight_grad_split.py; multi-rank float64 parity: tests/test_parity_pipeline.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopart import parallelize
from autopart.layout import Mesh
from autopart.runtime.runner import Runner


def _runner(model, batch, **plan) -> Runner:
    """The one rank of a one-device program, in this process."""
    prog = parallelize(model, Mesh(), example_inputs=batch, microbatches=2, **plan)
    rp = prog.rank(0)
    weights = {f: rp.shards[f].local(t.detach().clone()) for f, t in prog.params.items()}
    return Runner(rp, prog.plan, {**weights, **prog.buffers}, {})


@pytest.mark.parametrize("schedule,k", [("zb-h1", 1), ("seq1f1b-zb", 2)])
def test_b_leaves_the_weight_gradients_to_w_and_the_step_is_1f1bs(gpt_sdpa, schedule, k) -> None:
    model, batch = gpt_sdpa.model, gpt_sdpa.batch
    one = _runner(model, batch, schedule="1f1b")
    zb = _runner(model, batch, schedule=schedule, seq_chunks=k)
    seen: list[bool] = []  # at each W: did the B before it leave the deferred weights' grads?
    real_run = zb.comm.weights.run

    def spy(unit):
        works = zb.comm.weights.pending.get(unit, [])
        # the deferred GEMMs' inputs and output gradients count as held until this W
        held = zb._saved.live.get(("W", *unit), 0)
        seen.append(bool(works) and held == zb.comm.weights.held_bytes(unit) > 0)
        return real_run(unit)

    zb.comm.weights.run = spy
    try:
        loss_zb = zb.step(*batch)
    finally:
        zb.comm.weights.run = real_run
    loss_one = one.step(*batch)
    assert seen and all(seen)
    assert len(seen) == 2 * k  # one W per unit
    assert zb.stats.deferred_gemms > 0 and zb.stats.deferred_gemms % (2 * k) == 0
    assert not zb.comm.weights.pending and zb.comm.weights.collecting is None
    assert abs(loss_zb - loss_one) <= 1e-12 * abs(loss_one)
    for (name, p), (name2, q) in zip(zb.named_parameters(), one.named_parameters(), strict=True):
        assert name == name2
        assert (p.grad - q.grad).abs().max() <= 1e-12 * q.grad.abs().max(), name


def test_trace_and_timeline_show_w(gpt_sdpa, tmp_path) -> None:
    from autopart.runtime.timeline import busy_fractions, plot_timeline

    runner = _runner(gpt_sdpa.model, gpt_sdpa.batch, schedule="zb-h1")
    runner.timeline = []
    runner.step(*gpt_sdpa.batch)
    events = runner.chrome_trace()
    ws = [e for e in events if e["args"]["kind"] == "W"]
    assert len(ws) == 2 and {e["args"]["mb"] for e in ws} == {0, 1}
    w_time = sum(e["dur"] for e in ws)
    compute = sum(e["dur"] for e in events if e["args"]["kind"] in ("F", "B", "W"))
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    assert 0 < w_time < compute
    assert busy_fractions(events)[0] == pytest.approx(compute / span, rel=1e-4)  # W counts
    png = plot_timeline(events, tmp_path / "zb.png", "zb-h1")
    assert png.exists() and png.stat().st_size > 0


def test_bf16_sends_the_deferred_gradients_through_the_cast_to_the_masters(gpt_sdpa) -> None:
    """Under precision="bf16" the GEMMs read bf16 casts of the float32 masters: W sends dW back
    through the cast, so the masters get the same gradients as under 1F1B (to bf16 rounding)."""
    model, batch = copy.deepcopy(gpt_sdpa.model).float(), gpt_sdpa.batch
    one = _runner(model, batch, schedule="1f1b", precision="bf16")
    zb = _runner(model, batch, schedule="zb-h1", precision="bf16")
    one.step(*batch)
    zb.step(*batch)
    assert zb.stats.deferred_gemms > 0
    for (name, p), (_, q) in zip(zb.named_parameters(), one.named_parameters(), strict=True):
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        assert (p.grad - q.grad).abs().max() <= 2e-2 * q.grad.abs().max(), name


@pytest.mark.multirank
def test_a_waiting_rank_runs_deferred_w_and_the_gradients_are_the_same_bits() -> None:
    """Work while waiting (p2p.Channel.filler): a rank whose receive has not arrived runs
    deferred weight-gradient GEMMs, each gradient adds up in the schedule's order, and the
    receive's trace event starts after them."""
    import json
    from pathlib import Path

    from autopart.parity.verify import launch_forked

    script = Path(__file__).resolve().parent / "fill_script.py"
    out = launch_forked(2, [str(script)], timeout_s=120)
    res = next(json.loads(x) for x in out.splitlines() if x.startswith("{"))
    for schedule, r in res.items():
        # rank 1 waits for 3 of 4 micro-batches' activations (k chunks each), holding the
        # previous unit's deferred GEMMs every time
        assert r["filled"] > 0 and r["filled_without"] == 0, (schedule, r)
        assert r["deferred"][0] == r["deferred"][1], (schedule, r)  # the same GEMMs, all run
        assert r["w_events"] > r["units"], (schedule, r)  # W pieces besides the units' W
        assert r["no_overlap"] and r["bitwise"], (schedule, r)
