"""einsum_products: after this pass no two-operand ``einsum`` pairs tokens with tokens as a
batched matrix product. Each such einsum (attention's scores ``einsum("bqhd,bkhd->bhqk", q, k)``
and its product with the values ``einsum("bhqk,bkhd->bqhd", p, v)``, as lucidrains-style and
JAX-ported models write them) is a permute of each operand, one ``matmul`` and a permute of
the product, which ``canonicalize_attention`` recognizes as attention and the tensor-parallel
rules split by heads. Left as einsums, both found no rule: Seq1F1B refused the model and tp
kept its attention replicated.

Rewritten: an einsum of two operands with an explicit output and no ellipsis, in which each
letter appears at most once per operand, every letter of the output is an input's, and the
letters fall into batch letters (in both operands and the output, of equal sizes), exactly one
letter of the first operand only, one of the second only (both kept in the output) and one
contracted letter (in both operands, of equal size, not in the output); and in which an operand
or the output has two dims of the sequence's length (token pairs). Every other einsum stays as
it is (Mamba-2's block scans, whose dims are blocks of the sequence, are read by the Seq1F1B
rules as einsums). The values are the same products, summed over the same letter.
"""

from __future__ import annotations

import torch
from torch import fx

from autopart.frontend.capture import S, to_sympy
from autopart.frontend.shapes import propagate
from autopart.layout import Plan

aten = torch.ops.aten


def einsum_products(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    changed = False
    for n in list(gm.graph.nodes):
        if n.target == aten.einsum.default and _rewrite(gm, n):
            changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        propagate(gm)
    return gm


def _operands(n: fx.Node) -> tuple[str, str, str, fx.Node, fx.Node] | None:
    """(the first operand's letters, the second's, the output's, the two operands) of a
    rewritable einsum, or None."""
    eq, ops = n.args[0], n.args[1] if len(n.args) == 2 else None
    if not isinstance(eq, str) or not isinstance(ops, (list, tuple)) or len(ops) != 2 or n.kwargs:
        return None
    x, y = ops
    if not isinstance(x, fx.Node) or not isinstance(y, fx.Node):
        return None
    eq = eq.replace(" ", "")
    if "..." in eq or "->" not in eq or eq.count(",") != 1:
        return None
    lhs, out = eq.split("->")
    a, b = lhs.split(",")
    if not (a + b + out).isalpha() or any(len(set(t)) != len(t) for t in (a, b, out)):
        return None
    if not set(out) <= set(a) | set(b):
        return None
    vx, vy = x.meta.get("val"), y.meta.get("val")
    if not isinstance(vx, torch.Tensor) or not isinstance(vy, torch.Tensor):
        return None
    if vx.dim() != len(a) or vy.dim() != len(b):
        return None
    return a, b, out, x, y


def _rewrite(gm: fx.GraphModule, n: fx.Node) -> bool:
    found = _operands(n)
    if found is None:
        return False
    a, b, out, x, y = found
    batch = [c for c in out if c in a and c in b]
    left = [c for c in a if c in out and c not in b]
    right = [c for c in b if c in out and c not in a]
    summed = [c for c in a if c in b and c not in out]
    if len(left) != 1 or len(right) != 1 or len(summed) != 1:
        return False
    if len(a) != len(batch) + 2 or len(b) != len(batch) + 2:
        return False  # a letter of one operand only that the output drops (a sum)
    size = {c: to_sympy(s, gm) for c, s in zip(b, y.meta["val"].shape, strict=True)}
    for c, s in zip(a, x.meta["val"].shape, strict=True):
        if c in size and size[c] != to_sympy(s, gm):
            return False  # a broadcast of size 1 against another size: not a plain product
        size.setdefault(c, to_sympy(s, gm))
    if not any(sum(size[c] == S for c in t) >= 2 for t in (a, b, out)):
        return False  # pairs no tokens with tokens
    g = gm.graph
    with g.inserting_before(n):
        px = _permute(g, x, a, [*batch, *left, *summed])
        py = _permute(g, y, b, [*batch, *summed, *right])
        mm = g.call_function(aten.matmul.default, (px, py))
        res = _permute(g, mm, "".join([*batch, *left, *right]), list(out))
    for m in (px, py, mm, res):
        if m not in (x, y):
            m.meta.update({k: v for k, v in n.meta.items() if k != "val"})
    n.replace_all_uses_with(res)
    g.erase_node(n)
    return True


def _permute(g: fx.Graph, x: fx.Node, have: str, want: list[str]) -> fx.Node:
    order = [have.index(c) for c in want]
    if order == list(range(len(order))):
        return x
    return g.call_function(aten.permute.default, (x, order))
