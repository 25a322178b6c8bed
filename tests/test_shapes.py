"""``autopart/frontend/shapes.propagate``: every node's fake value recomputed after a pass. A
``view`` export wrote for a ``reshape`` (valid for the strides the traced input had) whose input a
pass rebuilt with other strides becomes the ``reshape`` it was (Inkling's attention under tp
failed here: "Cannot view a tensor … with strides"); a view whose sizes do not fit still fails,
naming the node."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopart.errors import AutopartError
from autopart.frontend.capture import capture
from autopart.frontend.shapes import propagate
from autopart.graph import copy_graph

aten = torch.ops.aten


class _Heads(nn.Module):
    """Heads laid out (b, s, h, d) in memory, transposed, scaled, and joined back by a view,
    valid for those strides (as export writes a reshape it traced as one)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.emb(ids).view(b, s, 4, 4).transpose(1, 2) * 2  # (b, h, s, d), strided
        return self.head(x.transpose(1, 2).view(b, s, -1))


def _restrided() -> torch.fx.GraphModule:
    ids = torch.randint(0, 50, (2, 8))
    gm = copy_graph(capture(_Heads().double(), (ids, ids)).graph)
    mul = next(n for n in gm.graph.nodes if n.target == aten.mul.Tensor)
    with gm.graph.inserting_after(mul):  # a pass that rebuilds it contiguous as (b, h, s, d)
        rebuilt = gm.graph.call_function(aten.clone.default, (mul,), {})
    rebuilt.kwargs = {"memory_format": torch.contiguous_format}
    mul.replace_all_uses_with(rebuilt, delete_user_cb=lambda u: u is not rebuilt)
    return gm


def test_a_view_of_restrided_input_becomes_the_reshape_it_was() -> None:
    gm = _restrided()
    joined = [n for n in gm.graph.nodes if n.target == aten.view.default and node_is_join(n)]
    assert len(joined) == 1
    propagate(gm)
    assert joined[0].target == aten.reshape.default
    assert tuple(joined[0].meta["val"].shape)[-1] == 16


def test_a_view_whose_sizes_do_not_fit_still_fails_by_name() -> None:
    gm = _restrided()
    join = next(n for n in gm.graph.nodes if n.target == aten.view.default and node_is_join(n))
    b, s, _ = join.args[1]
    join.args = (join.args[0], [b, s, 3])
    with pytest.raises(AutopartError, match=r"shapes do not fit at node %"):
        propagate(gm)


def node_is_join(n: torch.fx.Node) -> bool:
    """The view that joins the heads back: its input is a transpose."""
    src = n.args[0]
    return isinstance(src, torch.fx.Node) and src.target == aten.transpose.int
