"""Activation recomputation at run time: the regions the ``recompute`` pass marked, checkpointed.

``checkpointed(graph)`` returns a module that computes what ``graph`` computes, with each
recomputation region (the nodes from the first to the last one marked with region R, in graph
order) run under ``torch.utils.checkpoint`` (non-reentrant): its forward saves nothing for
backward but the region's inputs, and backward reruns it. Checkpointing saves those inputs
through an autograd function, so ``saved_tensors_hooks`` (the runtime's saved-bytes count)
see them like any other saved tensor, once per region. Regions are contiguous runs of the
graph's node order, so cutting there (``torch.fx`` ``split_module``) never makes a cycle;
a node another pass inserted between two marked nodes (a K/V prefix concatenation, a
collective) is recomputed with them.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from autopart.errors import AutopartError
from autopart.meta import META_RECOMPUTE


def regions(graph: fx.GraphModule) -> list[tuple[int, int]]:
    """[first, last] node positions of each region, in graph order; overlapping ones refused."""
    spans: dict[int, list[int]] = {}
    for i, n in enumerate(graph.graph.nodes):
        r = n.meta.get(META_RECOMPUTE)
        if r is not None and n.op == "call_function":
            span = spans.setdefault(r, [i, i])
            span[1] = i
    out = sorted((a, b) for a, b in spans.values())
    nodes = list(graph.graph.nodes)
    for (_, b0), (a1, _) in zip(out, out[1:], strict=False):
        if a1 <= b0:
            raise AutopartError(
                f"recomputation regions overlap at node {nodes[a1].name}: a pass moved nodes of "
                "one region between nodes of another",
                hint='compile with recompute="none" and report the model',
            )
    return out


def checkpointed(graph: fx.GraphModule) -> fx.GraphModule:
    """``graph`` with every recomputation region checkpointed (``graph`` itself if it has none)."""
    spans = regions(graph)
    if not spans:
        return graph
    part: dict[fx.Node, int] = {}  # node → its piece: runs between regions, and each region
    recomputed: set[int] = set()
    piece, inside = 0, None
    for i, n in enumerate(graph.graph.nodes):
        if n.op in ("placeholder", "output"):
            continue
        now = next((j for j, (a, b) in enumerate(spans) if a <= i <= b), None)
        if now != inside:
            piece, inside = piece + 1, now
        part[n] = piece
        if now is not None:
            recomputed.add(piece)
    split = split_module(graph, graph, part.__getitem__, keep_original_order=True)
    for p in recomputed:
        name = f"submod_{p}"
        setattr(split, name, _Checkpoint(getattr(split, name)))
    return split


class _Checkpoint(nn.Module):
    """Runs ``body`` under non-reentrant activation checkpointing."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, *args: object) -> object:
        if not torch.is_grad_enabled():
            return self.body(*args)
        return checkpoint(self.body, *args, use_reentrant=False)
