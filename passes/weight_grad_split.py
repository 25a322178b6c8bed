"""weight_grad_split: under a zero-bubble schedule, every parameter GEMM defers its weight gradient.

Invariant: when ``plan.split_backward`` (a zero-bubble schedule), no
``aten.linear``, ``aten.addmm``, ``aten.mm`` or ``aten.matmul`` whose weight (and bias, if any)
is a parameter placeholder is left: each is ``autopart::weight_gemm(x, w, b, form)``, the same
forward, whose backward returns the input gradient and leaves the weight and bias gradients to
the unit's ``W`` action (``autopart/deferred.py``). A GEMM on anything else (attention's
score products, a weight computed from a parameter) keeps its aten op, so its gradients stay in
``B``: deferring only ever moves parameter gradients, never an activation's. Other schedules
leave the graph unchanged. It rewrites each stage graph of the pipeline split. Node meta (layer, recompute region, tp split) is kept.
"""

from __future__ import annotations

import torch
from torch import fx

from autopart import deferred  # noqa: F401 - registers autopart::weight_gemm
from autopart.layout import Plan
from autopart.meta import META_INPUT
from autopart.node_args import node_arg, optional_node_arg
from autopart.passes.pipeline_split import stage_graphs

aten, ops = torch.ops.aten, torch.ops.autopart


def _param(n: object) -> bool:
    ref = n.meta.get(META_INPUT) if isinstance(n, fx.Node) else None
    return ref is not None and ref.kind == "param"


def _form(n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, str] | None:
    """(x, weight, bias, form) of a GEMM on a 2-D parameter weight, or None."""
    a = n.args
    if n.target == aten.linear.default:
        b = optional_node_arg(n, 2)
        if _param(a[1]) and (b is None or _param(b)):
            return node_arg(n, 0), node_arg(n, 1), b, "linear"
    elif n.target == aten.addmm.default and len(a) == 3 and not n.kwargs:
        if _param(a[2]) and _param(a[0]) and node_arg(n, 0).meta["val"].dim() == 1:
            return node_arg(n, 1), node_arg(n, 2), node_arg(n, 0), "addmm"
    elif (
        n.target in (aten.mm.default, aten.matmul.default)
        and _param(a[1])
        and node_arg(n, 1).meta["val"].dim() == 2
        and not _param(a[0])
    ):
        return node_arg(n, 0), node_arg(n, 1), None, "matmul"
    return None


def weight_grad_split(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.split_backward:
        return gm
    for st in stage_graphs(gm):
        for n in list(st.graph.nodes):
            form = _form(n) if n.op == "call_function" else None
            if form is None:
                continue
            with st.graph.inserting_before(n):
                new = st.graph.call_function(ops.weight_gemm.default, form)
            new.meta.update(n.meta)
            n.replace_all_uses_with(new)
            st.graph.erase_node(n)
        st.recompile()
    return gm
