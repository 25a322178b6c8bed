"""dropout_rng: no aten.dropout left; active dropouts draw explicit, reproducible masks."""

from __future__ import annotations

import nanogpt
import pytest
import torch

from autopart.frontend.capture import capture
from autopart.graph import copy_graph
from autopart.layout import Mesh, Plan
from autopart.lowering.pass_runner import run_passes
from autopart.meta import META_DROPOUT_SPLIT, META_INPUT
from autopart.passes import PIPELINE

aten, ops = torch.ops.aten, torch.ops.autopart


def _graph(dropout: float, tp: int):
    model, batch = nanogpt.make(dropout=dropout, attention="manual")
    gm, _ = run_passes(copy_graph(capture(model, batch).graph), Plan(Mesh(tp=tp)), PIPELINE)
    return gm


def test_zero_dropout_is_removed() -> None:
    gm = _graph(0.0, 1)
    assert not [
        n for n in gm.graph.nodes if n.target in (aten.dropout.default, ops.dropout.default)
    ]
    assert not [
        n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[META_INPUT].kind == "rng"
    ]


@pytest.mark.parametrize("tp", [1, 2])
def test_active_dropouts_get_slots_seed_and_split_flags(tp: int) -> None:
    gm = _graph(0.2, tp)
    assert not [n for n in gm.graph.nodes if n.target == aten.dropout.default]
    drops = [n for n in gm.graph.nodes if n.target == ops.dropout.default]
    assert len(drops) == 1 + 2 * 3  # embedding + per block: attention probs, two residuals
    assert sorted(n.args[3] for n in drops) == list(range(len(drops)))  # one slot each
    seeds = {n.args[2] for n in drops}
    assert len(seeds) == 1 and next(iter(seeds)).meta[META_INPUT].kind == "rng"
    split = [n.meta[META_DROPOUT_SPLIT] for n in drops]
    # with tp the per-head attention probabilities are split (own masks), the rest replicated
    assert split.count(True) == (2 if tp == 2 else 0)
    for n in drops:
        rank = n.args[4]
        assert (rank is not None) == n.meta[META_DROPOUT_SPLIT]


def test_masks_are_a_function_of_seed_slot_and_rank() -> None:
    x = torch.ones(64, 64, dtype=torch.float64)
    seed = torch.tensor(7)
    same = ops.dropout.default(x, 0.5, seed, 3, None)
    assert torch.equal(same, ops.dropout.default(x, 0.5, seed, 3, None))  # replicated: equal
    assert not torch.equal(same, ops.dropout.default(x, 0.5, torch.tensor(8), 3, None))
    assert not torch.equal(same, ops.dropout.default(x, 0.5, seed, 4, None))
    r0 = ops.dropout.default(x, 0.5, seed, 3, torch.tensor(0))
    r1 = ops.dropout.default(x, 0.5, seed, 3, torch.tensor(1))
    assert not torch.equal(r0, r1)  # split values: independent masks per tp rank
    kept = (same != 0).double().mean().item()
    assert 0.4 < kept < 0.6 and torch.allclose(
        same[same != 0], torch.full_like(same[same != 0], 2.0)
    )


def test_backward_uses_the_forward_mask() -> None:
    x = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor(11)
    y = ops.dropout.default(x, 0.3, seed, 0, None)
    y.sum().backward()
    mask = (y.detach() != 0).double() / 0.7
    assert torch.allclose(x.grad, mask)
