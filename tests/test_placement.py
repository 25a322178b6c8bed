"""Device-generic programs: a compiled program names no device, and every rank program runs on
the ``meta`` device (the dry run: real ranks, shape-only tensors and collectives), so a value
pinned to the CPU anywhere in a stage fails, naming its node."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parity_cases import LONG

from autopart import AutopartError, parallelize
from autopart.frontend.capture import capture
from autopart.frontend.spec import build
from autopart.layout import SCHEDULES, Mesh
from autopart.parity.checks import fork_ranks
from autopart.runtime.placement import backend_for, pick_device, place

pytestmark = pytest.mark.multirank

PLANS = {  # every schedule, on tp2 x pp2 (Seq1F1B with sequence parallelism, the acceptance plan)
    "gpipe": {"microbatches": 2},
    "1f1b": {"microbatches": 2},
    "interleaved-1f1b": {"microbatches": 2, "virtual_stages": 2},
    "seq1f1b": {"microbatches": 2, "seq_chunks": 2, "sequence_parallel": True},
    "seq1f1b-interleaved": {"microbatches": 2, "virtual_stages": 2, "seq_chunks": 2},
    "zb-h1": {"microbatches": 2},
    "seq1f1b-zb": {"microbatches": 2, "seq_chunks": 2, "sequence_parallel": True},
}


def _captured(name: str):
    model, batch = build(LONG[name])
    return capture(model, batch), batch


@pytest.fixture(scope="module")
def llama():
    return _captured("hf_llama")


def _dry_run(program, batch, folder: Path) -> list[dict]:
    fork_ranks(program, batch, folder, timeout_s=120, device="meta")
    return [torch.load(folder / f"rank{r:05d}.pt") for r in range(program.mesh.size)]


@pytest.fixture(scope="module")
def nano():
    return _captured("nanogpt")


def test_every_schedule_has_a_plan() -> None:
    assert set(PLANS) == set(SCHEDULES)


@pytest.mark.parametrize(  # two by default (suite time), every schedule with -m slow
    "name",
    [n if n in ("1f1b", "seq1f1b-zb") else pytest.param(n, marks=pytest.mark.slow) for n in PLANS],
)
def test_every_schedule_runs_on_meta(name: str, nano, tmp_path: Path) -> None:
    """nanoGPT under every schedule (HF Llama: the next test)."""
    captured, batch = nano
    kw = PLANS[name]
    program = parallelize(captured, Mesh(tp=2, pp=2), schedule=name, **kw)
    for r in range(program.mesh.size):
        for st in program.rank(r).stages:
            assert "device" not in st.graph.code, (name, r, st.stage)
    dumps = _dry_run(program, batch, tmp_path / name)
    for d in dumps:  # every gradient shard came back, shaped, on meta
        assert d["grads"] and all(g is not None for g in d["grads"].values()), name
        for fqn, g in d["grads"].items():
            assert g.device.type == "meta"
            shard = d["shards"][fqn]
            assert g.dim() == len(shard["shape"])
            assert g.shape[shard["dim"] or 0] == shard["shape"][shard["dim"] or 0] // (
                shard["parts"] if shard["dim"] is not None else 1
            )


@pytest.mark.slow  # the nanoGPT schedules above run on meta by default
def test_llama_seq1f1b_with_recompute_runs_on_meta(llama, tmp_path: Path) -> None:
    """HF Llama (rotary tables cast to float32 and back, GQA) under tp2 x pp2 Seq1F1B with
    sequence parallelism and full recomputation."""
    captured, batch = llama
    program = parallelize(
        captured, Mesh(tp=2, pp=2), schedule="seq1f1b", recompute="full", **PLANS["seq1f1b"]
    )
    assert all(d["grads"] for d in _dry_run(program, batch, tmp_path))


def test_a_cpu_pinned_constant_fails_the_dry_run(llama, tmp_path: Path) -> None:
    """Negative control: one stage with an ``arange`` pinned to the CPU (as capture bakes it)
    added to its hidden state fails on meta, naming that node; the same program runs on CPU."""
    captured, batch = llama
    program = parallelize(captured, Mesh(pp=2), microbatches=2)
    st = program.rank(1).stages[0].graph
    g = st.graph
    out = next(n for n in g.nodes if n.op == "output")
    first = next(n for n in g.nodes if n.op == "call_function")
    with g.inserting_after(first):
        pinned = g.call_function(
            torch.ops.aten.scalar_tensor.default, (0.0,), {"device": torch.device("cpu")}
        )
        pinned.name = "pinned_zero"
    with g.inserting_before(out):  # loss + 0 on the CPU: no value changes
        loss = out.args[0][0]
        moved = g.call_function(torch.ops.aten.add.Tensor, (loss, pinned))
    out.args = ((moved, *out.args[0][1:]),)
    st.recompile()
    fork_ranks(program, batch, tmp_path / "cpu", timeout_s=120)  # fine where it was captured
    with pytest.raises(AutopartError, match=r"rank 1 .*node pinned_zero .*on cpu in a program"):
        _dry_run(program, batch, tmp_path / "meta")


def test_place_and_pick() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    made = graph.call_function(torch.ops.aten.arange.default, (3,))
    pinned = graph.call_function(torch.ops.aten.zeros.default, ([3],), {"device": "cpu"})
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (x, made)), pinned))
    placed = place(torch.fx.GraphModule({}, graph), torch.device("meta"))
    out, kept = placed(torch.empty(3, device="meta"))
    assert out.device.type == "meta"  # the factory call took the rank's device
    assert kept.device.type == "cpu"  # a device already named stays: the dry run shows it
    assert pick_device("cpu") == torch.device("cpu") and backend_for(torch.device("cpu")) == "gloo"
    assert pick_device("meta").type == "meta"
    with pytest.raises(AutopartError, match="unknown device"):
        pick_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(AutopartError, match="CUDA is not available"):
            pick_device("cuda")
