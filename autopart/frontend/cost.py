"""Cost analysis: FLOPs, bytes moved and activation bytes per node, as sympy expressions.

After ``analyze(captured)`` every call node has ``meta["autopart.cost"]``: a ``Cost`` whose
fields are sympy expressions in the batch symbol ``b`` and sequence symbol ``s``.

Conventions (forward pass only; the usual estimate of backward is 2× the forward):

- a matmul of an (m × k) by a (k × n) operand counts ``2·m·k·n`` FLOPs (``mm_flops``);
- causal attention (``scaled_dot_product_attention(..., is_causal=True)``) with ``s`` queries,
  ``P`` keys (``P = s`` without a KV prefix) and head width ``d`` counts its two matmuls only
  below the diagonal, ``4·b·h·d·(s·P − s²/2)``, not the full square ``4·b·h·d·s·P``;
- an elementwise or reduction op counts one FLOP per output element (``flops - mm_flops``);
- views, reshapes, embeddings (gathers) and size queries count no FLOPs;
- ``bytes`` = bytes read from tensor inputs + bytes written; ``act_bytes`` = bytes of the
  node's output unless the output is a view of an input (then 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx

from autopart.frontend.capture import B, Captured, S, to_sympy
from autopart.meta import META_ATTENTION, META_COST, META_INPUT, META_LAYER, META_SYMBOLS
from autopart.node_args import node_arg

ZERO = sympy.Integer(0)

_VIEWS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "t",
        "permute",
        "expand",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "alias",
        "as_strided",
        "unflatten",
        "flatten",
        "chunk",
        "unbind",
        "detach",
        "lift_fresh_copy",
        "sym_size",
        "_assert_tensor_metadata",
        "to",
    }
)
_GATHERS = frozenset({"embedding", "index", "arange", "ones", "zeros", "new_ones", "full", "empty"})
_MATMULS = frozenset({"mm", "bmm", "matmul", "linear", "addmm", "baddbmm"})


@dataclass(frozen=True)
class Cost:
    """Forward cost of one node (sympy expressions in b and s)."""

    flops: sympy.Expr = ZERO
    mm_flops: sympy.Expr = ZERO
    bytes: sympy.Expr = ZERO
    act_bytes: sympy.Expr = ZERO

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=False)))

    def astuple(self) -> tuple[sympy.Expr, ...]:
        return (self.flops, self.mm_flops, self.bytes, self.act_bytes)


def total(costs: Iterable[Cost]) -> Cost:
    """Sum of many costs (one sympy Add per field: fast on thousands of nodes)."""
    cols = list(zip(*(c.astuple() for c in costs), strict=False)) or [(ZERO,)] * 4
    return Cost(*(sympy.Add(*col) for col in cols))


@dataclass
class Group:
    """Cost of a contiguous part of the model: the embedding, one block, or the head + loss."""

    name: str
    layer: int | None
    params: int
    cost: Cost
    nodes: list[str] = field(default_factory=list)


def _size(x: object, gm: fx.GraphModule) -> sympy.Expr:
    """A size in b and s. A data-dependent size (the tokens a router sends to one expert: an
    unbacked symbol) is taken at its bound, every token of the batch (b·s), so costs stay
    expressions in b and s."""
    expr = to_sympy(x, gm)
    known = {B, S, *gm.meta.get(META_SYMBOLS, {}).values()}
    extra = expr.free_symbols - known
    return expr.xreplace({u: B * S for u in extra}) if extra else expr


def _numel(val: torch.Tensor, gm: fx.GraphModule) -> sympy.Expr:
    return sympy.Mul(*(_size(d, gm) for d in val.shape)) if val.dim() else sympy.Integer(1)


def _tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _bytes(vals: list[torch.Tensor], gm: fx.GraphModule) -> sympy.Expr:
    return sympy.Add(*(_numel(v, gm) * v.element_size() for v in vals)) if vals else ZERO


def node_cost(node: fx.Node, gm: fx.GraphModule) -> Cost:
    """The forward cost of one call node (see the module docstring for the conventions)."""
    op = getattr(node.target, "_opname", getattr(node.target, "__name__", str(node.target)))
    outs = _tensors(node.meta.get("val"))
    ins = [v for a in node.all_input_nodes for v in _tensors(a.meta.get("val"))]
    if op in _VIEWS or op == "getitem" or not outs:
        return Cost()
    moved = _bytes(ins, gm) + _bytes(outs, gm)
    act = _bytes(outs, gm)
    if op in _GATHERS:
        return Cost(bytes=moved, act_bytes=act)
    out = outs[0]
    if op in _MATMULS:
        a = node_arg(node, 1 if op in ("addmm", "baddbmm") else 0).meta["val"]
        k = _size(a.shape[-1], gm)
        mm = 2 * _numel(out, gm) * k
        return Cost(flops=mm, mm_flops=mm, bytes=moved, act_bytes=act)
    if op in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention"):
        q, k = node_arg(node, 0).meta["val"], node_arg(node, 1).meta["val"]
        b_h = sympy.Mul(*(_size(d, gm) for d in q.shape[:-2]))
        sq, sk, d = (
            _size(q.shape[-2], gm),
            _size(k.shape[-2], gm),
            _size(q.shape[-1], gm),
        )
        slot = (
            5 if op == "scaled_dot_product_attention" else 4
        )  # flash: (q, k, v, dropout, is_causal)
        causal = bool(
            node.kwargs.get("is_causal", node.args[slot] if len(node.args) > slot else False)
        ) or "causal" in str(node.meta.get(META_ATTENTION, ""))  # a windowed or chunked
        # causal SDPA has an explicit mask: counted as causal (the window's saving is not)
        pairs = sq * sk - sq**2 / 2 if causal else sq * sk
        mm = 4 * b_h * d * pairs
        return Cost(flops=mm + 3 * b_h * pairs, mm_flops=mm, bytes=moved, act_bytes=act)
    return Cost(flops=_numel(out, gm), bytes=moved, act_bytes=act)


def analyze(captured: Captured) -> list[Group]:
    """Annotate every call node with its ``Cost``; return the costs rolled up per group.

    Groups, in graph order: ``embed`` (everything before the first block), ``block i`` for each
    transformer block, ``head`` (everything after the last block: final norm, LM head, loss).
    Parameter counts are per group, tied parameters counted once, where first used.
    """
    gm = captured.graph
    per: dict[str, list[fx.Node]] = {}
    layers: dict[str, int | None] = {}
    seen_block = False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        node.meta[META_COST] = node_cost(node, gm) if node.op == "call_function" else Cost()
        layer = node.meta.get(META_LAYER)
        seen_block |= layer is not None
        name = f"block {layer}" if layer is not None else ("head" if seen_block else "embed")
        per.setdefault(name, []).append(node)
        layers[name] = layer
    owner: dict[str, str] = {}
    for name, nodes in per.items():
        for n in nodes:
            for a in n.all_input_nodes:
                ref = a.meta.get(META_INPUT)
                if ref is not None and ref.kind == "param":
                    owner.setdefault(ref.name, name)
    groups = []
    for name, nodes in per.items():
        n_params = sum(captured.params[f].numel() for f, g in owner.items() if g == name)
        groups.append(
            Group(
                name,
                layers[name],
                n_params,
                total(n.meta[META_COST] for n in nodes),
                [n.name for n in nodes],
            )
        )
    return groups


def evaluate(expr: sympy.Expr, b: int, s: int) -> float:
    """Value of a cost expression at batch ``b`` and sequence ``s``."""
    return float(sympy.sympify(expr).subs({B: b, S: s}))
