"""fold_identities: after this pass the graph holds no op that is an identity on every input the
captured model accepts:

- ``sym_min(x, c)`` / ``sym_max(x, c)`` of a size x and a constant c that export's range
  constraints on x's symbols decide (x ≤ c, or x ≥ c, at every length the model fits): the
  decided side. MiniMax's lightning attention slices its blocks to ``min(s, 256)`` where
  export bounds s to [2, 256]: the slices are then whole (``x[:, :s]``), which the Seq1F1B
  rules can prove per token, where ``Min(256, s)`` named no length they know;
- ``cat([x], dim)``, a concatenation of one tensor: ``x`` (in a functional graph, the same
  values).

A longer sequence than export's bound is refused before any step (``Plan.max_seq``,
``frontend.shapes.longest_sequence``), so the folded graph computes what the model does
wherever it runs. The values of every node are unchanged; only the sizes' expressions and the
nodes named above go.
"""

from __future__ import annotations

import torch
import torch.utils._sympy.value_ranges as vr
from torch import fx

from autopart.frontend.shapes import propagate
from autopart.graph import remove_dead
from autopart.layout import Plan
from autopart.meta import META_RANGES

aten = torch.ops.aten


def fold_identities(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    ranges = gm.meta.get(META_RANGES, {})
    changed = False
    for n in list(gm.graph.nodes):
        same = None
        if n.target in (torch.sym_min, torch.sym_max) and len(n.args) == 2 and not n.kwargs:
            same = _decided(n, ranges)
        elif n.target == aten.cat.default and len(n.args[0]) == 1:
            x = n.args[0][0]
            out = n.meta.get("val")
            if isinstance(x, fx.Node) and getattr(x.meta.get("val"), "dtype", 0) == out.dtype:
                same = x
        if same is not None:
            n.replace_all_uses_with(same)
            changed = True
    if changed:
        remove_dead(gm)
        propagate(gm)
    return gm


def _decided(n: fx.Node, ranges: dict) -> fx.Node | None:
    """The argument of a min/max of a size node and an int that is its value at every size
    export's ranges admit, or None."""
    a, b = n.args
    x, c = (a, b) if isinstance(a, fx.Node) else (b, a)
    if not isinstance(x, fx.Node) or not isinstance(c, int) or isinstance(c, bool):
        return None
    val = x.meta.get("val")
    if not isinstance(val, torch.SymInt):
        return None
    expr = val.node.expr
    if not expr.free_symbols <= set(ranges):
        return None
    bound = vr.bound_sympy(expr, {s: ranges[s] for s in expr.free_symbols})
    if n.target is torch.sym_min and bound.upper <= c:
        return x
    if n.target is torch.sym_max and bound.lower >= c:
        return x
    return None
