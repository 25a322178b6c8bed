"""recompute: after this pass every node whose saved activations ``plan.recompute`` drops carries
``meta["autopart.recompute"] = R``, the index of its recomputation region.

Invariant: with ``"full"`` region i holds exactly the calls of transformer block i that compute
on activations (the pipeline split's block units; positions, masks and rotary tables computed
from no activation stay outside and are region inputs), so only each block's input is kept;
with ``"selective"`` each region is one attention core — the activation-dependent values with
two sequence dimensions (the b·h·s² scores, softmax and dropout), the calls that consume them,
and every ``scaled_dot_product_attention`` — so no projection or MLP matmul is ever in a region;
with ``"none"`` no node carries the key. Regions are numbered in graph order.

The pass only marks; ``autopart/runtime/recompute.py`` runs each region under activation
checkpointing (its forward keeps only the region's inputs; backward reruns it). Rerunning is
exact: dropout draws its mask from explicit seeds (``dropout_rng``), and collectives inside a
region run again on every tp rank at the same backward step. The mark survives the pipeline
split and sequence chunking (node meta is copied) and is saved with the program.
"""

from __future__ import annotations

import networkx as nx
import sympy
import torch
from torch import fx

from autopart.frontend.capture import B, S, to_sympy
from autopart.layout import Plan
from autopart.meta import META_RECOMPUTE
from autopart.passes.pipeline_split import block_units, recomputable

aten = torch.ops.aten
ATTENTION_OPS = (
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
)


def recompute(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if plan.recompute == "none":
        return gm
    groups = full_regions(gm) if plan.recompute == "full" else attention_cores(gm)
    for r, nodes in enumerate(groups):
        for n in nodes:
            n.meta[META_RECOMPUTE] = r
    return gm


def full_regions(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The activation-dependent calls of each transformer block, block by block."""
    units, _ = block_units(gm)
    last = max(units.values(), default=0)  # unit 0: embedding, last: head and loss
    blocks: dict[int, list[fx.Node]] = {}
    for n, u in units.items():
        if 0 < u < last:
            blocks.setdefault(u, []).append(n)
    return [blocks[u] for u in sorted(blocks)]


def attention_cores(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Each attention's s²-sized part: connected sets of activation-dependent nodes with two
    sequence dimensions, with their consumers, and every fused attention call."""
    fixed = recomputable(gm)
    square = {
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n not in fixed and _seq_dims(n, gm) >= 2
    }
    core = set(square)
    core |= {u for n in square for u in n.users if u.op == "call_function"}
    core |= {n for n in gm.graph.nodes if n.target in ATTENTION_OPS and n not in fixed}
    graph = nx.Graph()
    graph.add_nodes_from(core)
    graph.add_edges_from((a, n) for n in core for a in n.all_input_nodes if a in core)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups = [sorted(c, key=order.__getitem__) for c in nx.connected_components(graph)]
    return sorted(groups, key=lambda g: order[g[0]])


def _seq_dims(n: fx.Node, gm: fx.GraphModule) -> int:
    """How many dimensions of a node's tensor value are the sequence length s."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return sum(is_sequence(to_sympy(d, gm)) for d in val.shape)


def is_sequence(size: sympy.Expr) -> bool:
    """The size equals s at every sequence length (``s``, or ``2·(s//2)`` as sequence
    parallelism's gather writes it), whatever the batch; checked at two lengths."""
    return all(size.xreplace({S: s, B: 3}) == s for s in (4096, 6144))
