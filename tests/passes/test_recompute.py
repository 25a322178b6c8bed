"""recompute: the regions it marks are exactly each block (full) or each attention core
(selective), and the runtime's checkpointed graph computes what the graph computes."""

from __future__ import annotations

import functools

import hf_gpt2
import hf_llama
import nanogpt
import pytest
import sympy
import torch
from torch import fx

from autopart.errors import AutopartError
from autopart.frontend.capture import S, capture, to_sympy
from autopart.graph import copy_graph
from autopart.layout import Mesh, Plan
from autopart.lowering.pass_runner import run_passes
from autopart.meta import META_INPUT, META_LAYER, META_RECOMPUTE
from autopart.passes import PIPELINE
from autopart.passes.pipeline_split import block_units, recomputable
from autopart.passes.recompute import is_sequence
from autopart.runtime.recompute import checkpointed, regions

aten = torch.ops.aten
MODELS = {
    "nanogpt-manual": lambda: nanogpt.make(attention="manual", n_layer=3),
    "nanogpt-sdpa": lambda: nanogpt.make(n_layer=3),
    "hf-gpt2": lambda: hf_gpt2.make(n_layer=3),
    "hf-llama": lambda: hf_llama.make(n_layer=3),
}


@functools.cache
def _captured(name: str):
    model, batch = MODELS[name]()
    return capture(model, batch)


def _graph(name: str, recompute: str) -> fx.GraphModule:
    plan = Plan(Mesh(), recompute=recompute)
    gm, _ = run_passes(copy_graph(_captured(name).graph), plan, PIPELINE)
    return gm


def _marked(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: n.meta[META_RECOMPUTE] for n in gm.graph.nodes if META_RECOMPUTE in n.meta}


@pytest.mark.parametrize("name", list(MODELS))
def test_none_marks_nothing(name: str) -> None:
    assert not _marked(_graph(name, "none"))


@pytest.mark.parametrize("name", list(MODELS))
def test_full_marks_each_block_and_nothing_else(name: str) -> None:
    gm = _graph(name, "full")
    marked = _marked(gm)
    units, _ = block_units(gm)
    head = max(units.values())
    fixed = recomputable(gm)
    assert sorted(set(marked.values())) == [0, 1, 2]  # one region per block, in order
    for n, u in units.items():
        assert marked.get(n) == (u - 1 if 0 < u < head else None), n.name
    assert not (set(marked) & fixed)  # positions, masks, rotary tables stay region inputs
    layers = {
        r: {n.meta.get(META_LAYER) for n in marked if marked[n] == r} - {None} for r in range(3)
    }
    assert all(len(v) == 1 for v in layers.values()), layers


def _square(n: fx.Node, gm: fx.GraphModule) -> bool:
    val = n.meta.get("val")
    return (
        isinstance(val, torch.Tensor) and sum(is_sequence(to_sympy(d, gm)) for d in val.shape) >= 2
    )


def test_sequence_sizes() -> None:
    b = sympy.Symbol("b")
    assert is_sequence(S) and is_sequence(2 * sympy.floor(S / 2))
    assert not is_sequence(S / 2) and not is_sequence(b) and not is_sequence(sympy.Integer(8))
    assert not is_sequence(S + 1) and not is_sequence(sympy.Symbol("p") + S)


@pytest.mark.parametrize("name", list(MODELS))
def test_selective_marks_attention_cores_only(name: str) -> None:
    gm = _graph(name, "selective")
    marked = _marked(gm)
    fixed = recomputable(gm)
    assert sorted(set(marked.values())) == [0, 1, 2]  # one core per block
    square = [n for n in gm.graph.nodes if n.op == "call_function" and n not in fixed]
    assert all(n in marked for n in square if _square(n, gm))  # every s²-sized value
    params = {
        n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[META_INPUT].kind == "param"
    }
    for n in marked:  # no projection or MLP matmul: no parameter feeds a region directly
        assert not (set(n.all_input_nodes) & params), n.name
    assert not (set(marked) & fixed)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_checkpointed_graph_computes_the_same_loss_and_gradients(recompute: str) -> None:
    gm = _graph("hf-llama", recompute)
    model, (x, y) = MODELS["hf-llama"]()
    captured = capture(model, (x, y))
    values = {**captured.params, **captured.buffers}
    args = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            ref = n.meta[META_INPUT]
            args.append({"input_ids": x, "labels": y}.get(ref.name, values.get(ref.name)))
    assert len(regions(gm)) == 3
    run = checkpointed(gm)
    assert run is not gm

    def loss_and_grads(fn):
        leaves = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
        (loss,) = fn(*leaves)
        loss.backward()
        return loss.detach(), [a.grad for a in leaves if a.is_floating_point()]

    ref_loss, ref_grads = loss_and_grads(gm)
    loss, grads = loss_and_grads(run)
    assert torch.equal(loss, ref_loss)
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g is None and r is None) or torch.allclose(g, r, rtol=1e-6, atol=1e-7)


def test_overlapping_regions_are_refused() -> None:
    gm = _graph("nanogpt-sdpa", "full")
    first = next(n for n in gm.graph.nodes if n.meta.get(META_RECOMPUTE) == 0)
    last = [n for n in gm.graph.nodes if n.meta.get(META_RECOMPUTE) == 1][-1]
    first.meta[META_RECOMPUTE] = 1  # region 1 now spans region 0
    assert len(regions(_graph("nanogpt-sdpa", "full"))) == 3  # the untouched graph is fine
    with pytest.raises(AutopartError, match="regions overlap"):
        regions(gm)
    assert last.meta[META_RECOMPUTE] == 1
