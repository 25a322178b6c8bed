"""``fold_identities``: a min or max of a size that export's range constraints decide becomes
its decided side, a concatenation of one tensor becomes the tensor; the graph computes the same
loss and gradients, and a min that export does not decide stays."""

from __future__ import annotations

import dataclasses

import torch
from conftest import run_graph
from test_position_masks import _Linear
from torch import nn

from autopart import Mesh
from autopart.frontend.capture import capture
from autopart.graph import copy_graph
from autopart.layout import Plan
from autopart.passes.fold_identities import fold_identities


class _Open(nn.Module):
    """A slice to min(s, 8): export bounds nothing (a longer sequence keeps 8 tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 8), nn.Linear(8, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        first = x[:, : min(ids.shape[1], 8)].sum(1, keepdim=True)
        return self.out(x + first)


def _folded(model: nn.Module) -> tuple:
    ids = torch.randint(1, 50, (2, 16))
    captured = capture(model.double(), (ids, ids))
    gm = copy_graph(captured.graph)
    gm.meta.update(captured.graph.meta)
    folded = fold_identities(gm, Plan(Mesh()))
    return captured, dataclasses.replace(captured, graph=folded), (ids, ids)


def test_a_decided_min_and_a_one_tensor_cat_fold_away() -> None:
    """MiniMax's block loop, bounded by export to one block of 32: before, min(s, 32) cuts the
    block and a cat joins the one block; after, neither, and the slices are whole (their size is
    the length itself); the loss and every gradient are the same bits."""
    captured, folded, batch = _folded(_Linear("lightning"))

    def count(gm) -> tuple[int, int]:
        nodes = list(gm.graph.nodes)
        return (
            sum(n.target is torch.sym_min for n in nodes),
            sum(n.target == torch.ops.aten.cat.default and len(n.args[0]) == 1 for n in nodes),
        )

    assert count(captured.graph) == (1, 1) and count(folded.graph) == (0, 0)
    slices = [n for n in folded.graph.graph.nodes if n.target == torch.ops.aten.slice.Tensor]
    assert slices and not any("Min" in str(n.meta["val"].shape) for n in slices)
    want, want_grads = run_graph(captured, batch)
    got, grads = run_graph(folded, batch)
    assert torch.equal(got, want)
    assert all(torch.equal(grads[f], want_grads[f]) for f in want_grads)


def test_a_min_export_does_not_decide_stays() -> None:
    """Negative control: min(s, 8) with s unbounded is no identity; it stays."""
    _, folded, _ = _folded(_Open())
    assert any(n.target is torch.sym_min for n in folded.graph.graph.nodes)
