"""Sharding rules for the tensor-parallel passes: how a split of one dim moves through an op.

``out_dim(node, dims)`` answers, for a node some of whose tensor inputs are split along a
dim (``dims[input]``; other inputs replicated), which dim of its output is split — or raises
``Illegal`` when the op needs the whole dim (a norm over it, a slice of it, a replicated
operand that spans it). Rules are keyed by ATen op; anything unknown is illegal, so the pass
never shards through an op it does not understand.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection
from typing import Any

import sympy
import torch
from torch import fx

from autopart.meta import META_INPUT, META_MASK_FN
from autopart.node_args import node_arg, optional_node_arg, whole_slice

aten = torch.ops.aten


class Illegal(Exception):
    """The split cannot pass through this node."""


def tensor_val(n: object) -> torch.Tensor | None:
    if isinstance(n, fx.Node):
        v = n.meta.get("val")
        return v if isinstance(v, torch.Tensor) else None
    return None


def tensor_of(n: object) -> torch.Tensor:
    """``tensor_val`` of a node known to hold a tensor."""
    v = tensor_val(n)
    assert v is not None, f"{n} holds no tensor"
    return v


def _ndim(n: fx.Node) -> int:
    v = tensor_val(n)
    if v is None:
        raise Illegal(f"{n.name} has no tensor value")
    return v.dim()


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _pointwise(n: fx.Node, dims: dict[fx.Node, int]) -> int:
    out = _ndim(n)
    found: set[int] = set()
    tensors = [a for a in n.all_input_nodes if tensor_val(a) is not None]
    for a in tensors:
        if a in dims:
            found.add(dims[a] + out - _ndim(a))
    if len(found) != 1:
        raise Illegal(f"operands split along different dims {sorted(found)}")
    d = found.pop()
    if not 0 <= d < out:
        raise Illegal(f"an operand's split dim {d} is not a dim of the {out}-d output")
    for a in tensors:
        if a not in dims:
            pos = d - (out - _ndim(a))
            if pos >= len(tensor_of(a).shape):
                raise Illegal(f"operand {a.name} has more dims than the output")
            if pos >= 0 and tensor_of(a).shape[pos] != 1:
                raise Illegal(f"replicated operand {a.name} spans the split dim {d}")
    return d


def _first(n: fx.Node, dims: dict[fx.Node, int]) -> int:
    src = n.args[0]
    if not isinstance(src, fx.Node) or src not in dims:
        raise Illegal("only a non-first operand is split")
    return dims[src]


def _transpose(n, dims):
    d, nd = _first(n, dims), _ndim(n)
    a, b = _norm(n.args[1], nd), _norm(n.args[2], nd)
    return b if d == a else a if d == b else d


def _permute(n, dims):
    d = _first(n, dims)
    order = [_norm(x, _ndim(n)) for x in n.args[1]]
    return order.index(d)


def _unsqueeze(n, dims):
    d = _first(n, dims)
    k = _norm(n.args[1], _ndim(n))
    return d + 1 if k <= d else d


def _squeeze(n, dims):
    d = _first(n, dims)
    src = n.args[0]
    ks = (
        n.args[1] if len(n.args) > 1 else [i for i, s in enumerate(tensor_val(src).shape) if s == 1]
    )
    ks = [_norm(k, _ndim(src)) for k in (ks if isinstance(ks, (list, tuple)) else [ks])]
    if d in ks:
        raise Illegal("squeezes the split dim")
    return d - sum(k < d for k in ks)


def _expand(n, dims):
    d = _first(n, dims)
    return d + len(n.args[1]) - _ndim(n.args[0])


def _not_along(arg: int):
    def rule(n, dims):
        d = _first(n, dims)
        dim = n.args[arg] if len(n.args) > arg else n.kwargs.get("dim", 0)
        if _norm(dim, _ndim(n.args[0])) == d and not whole_slice(n):
            raise Illegal(f"{n.target} works along the split dim")
        return d

    return rule


def _expand_as(n, dims):
    """``x.expand_as(like)`` (``F.normalize``'s norm expanded to x): both split along the same
    output dim, so each rank expands its part to its part's shape."""
    x, like = n.args[0], n.args[1]
    if x not in dims or like not in dims:
        raise Illegal("expands between a split and a replicated value")
    d = dims[x] + _ndim(like) - _ndim(x)
    if dims[like] != d:
        raise Illegal("expands to a value split along another dim")
    return d


def _repeat_interleave(n, dims):
    """``x.repeat_interleave(r, dim)``: each of the dim's rows repeated r times in place, so a
    rank's contiguous block of rows gives the output's block of the same ranks (GQA's key
    heads repeated for their query heads). Flattening (no dim) or a stated output size along
    the split dim is not proven."""
    d = _first(n, dims)
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
    if not isinstance(dim, int):
        raise Illegal("repeat_interleave without a dim flattens the split")
    if _norm(dim, _ndim(n.args[0])) != d:
        return d
    if (n.args[3] if len(n.args) > 3 else n.kwargs.get("output_size")) is not None:
        raise Illegal("repeat_interleave states its output size along the split dim")
    return d


def _split(n, dims):
    return _first(n, dims)  # splits along the split dim are strided: handled by the pass


def _unbind(n, dims):
    """``x.unbind(dim)`` (``q, k, v = qkv.unbind(2)``): each part keeps the split, one dim
    lower when ``dim`` was before it; unbinding the split dim itself is not proven."""
    d = _first(n, dims)
    dim = _norm(n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0), _ndim(n.args[0]))
    if d == dim:
        raise Illegal("unbinds the split dim")
    return d - (dim < d)


def _cat(n, dims):
    tensors = n.args[0]
    if not all(t in dims for t in tensors):
        raise Illegal("cat of split and replicated tensors")
    ds = {dims[t] for t in tensors}
    dim = _norm(n.args[1] if len(n.args) > 1 else 0, _ndim(n))
    if len(ds) != 1 or dim in ds:
        raise Illegal("cat along the split dim")
    return ds.pop()


def _stack(n, dims):
    tensors = n.args[0]
    if not all(t in dims for t in tensors):
        raise Illegal("stack of split and replicated tensors")
    ds = {dims[t] for t in tensors}
    if len(ds) != 1:
        raise Illegal(f"operands split along different dims {sorted(ds)}")
    d = ds.pop()
    new = _norm(n.args[1] if len(n.args) > 1 else 0, _ndim(n))
    return d if d < new else d + 1


def _flatten(n, dims):
    d, nd = _first(n, dims), _ndim(n.args[0])
    start = _norm(n.args[1] if len(n.args) > 1 else 0, nd)
    end = _norm(n.args[2] if len(n.args) > 2 else -1, nd)
    if d < start:
        return d
    if d > end:
        return d - (end - start)
    if d == start:  # the outer dim of the merge: each rank keeps a contiguous block
        return start
    raise Illegal("flattens the split dim into an outer one")


def _reduce(n, dims, at: int = 1):
    """A reduction over the dims of argument ``at`` (``linalg_vector_norm``'s come after its
    order: 2), kept when its next argument, keepdim, says so."""
    d = _first(n, dims)
    nd = _ndim(n.args[0])
    over = n.args[at] if len(n.args) > at else n.kwargs.get("dim")
    if over is None or (isinstance(over, (list, tuple)) and not over):
        over = list(range(nd))  # dim None or [] (``x.sum(dim=())``): every dim
    over = [_norm(x, nd) for x in (over if isinstance(over, (list, tuple)) else [over])]
    keep = n.args[at + 1] if len(n.args) > at + 1 else n.kwargs.get("keepdim", False)
    if d in over:
        raise Illegal("reduces over the split dim")
    return d if keep else d - sum(x < d for x in over)


def _layer_norm(n, dims):
    d = _first(n, dims)
    if d >= _ndim(n) - len(n.args[1]):
        raise Illegal("normalizes over the split dim")
    return d


def _attention(n, dims):
    q, k, v = n.args[:3]
    heads = _ndim(q) - 3
    if q in dims and k not in dims and v not in dims:  # replicated keys and values:
        if dims[q] != heads:  # tensor_parallel selects this rank's heads of them
            raise Illegal("attention split along a dim other than the heads")
    elif not (q in dims and k in dims and v in dims):
        raise Illegal("attention with only some of q, k, v split")
    elif not dims[q] == dims[k] == dims[v] == heads:
        raise Illegal("attention split along a dim other than the heads")
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        if mask in dims:
            raise Illegal("split attention mask")
        m = tensor_val(mask)
        pos = heads - (_ndim(q) - m.dim())
        if pos >= 0 and m.shape[pos] != 1 and not per_head_mask(n):
            raise Illegal("attention mask differs per head")
    return heads


def per_head_mask(n: fx.Node) -> int | None:
    """The head dim of an SDPA's mask that differs per head and that ``position_masks`` rebuilt
    from sizes and buffers (ALiBi's slopes): the same on every rank, so each rank may take its
    own heads' rows of it (``tensor_parallel._mask_heads``); None for any other mask."""
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    q, m = tensor_val(n.args[0]), tensor_val(mask)
    if q is None or m is None or not isinstance(mask, fx.Node) or not mask.meta.get(META_MASK_FN):
        return None
    pos = m.dim() - 3  # q is [..., heads, L, E]: the mask's dim aligned with the heads
    if pos < 0 or m.shape[pos] == 1 or str(m.shape[pos]) != str(q.shape[-3]):
        return None
    return pos


def _batched_matmul(n, dims):
    a, b = n.args[:2]
    if a in dims and b in dims and dims[a] == dims[b] and dims[a] < _ndim(n) - 2:
        return dims[a]
    if (a in dims) != (b in dims):  # one replicated operand (the keys of heads split by the
        split = a if a in dims else b  # queries): tensor_parallel selects this rank's part
        d = dims[split] + _ndim(n) - _ndim(split)
        if d < _ndim(n) - 2 and (_spans(n, split, d) is not None or _broadcasts(n, split, d)):
            return d
    raise Illegal("matmul of activations split along a non-batch dim")


def _other(n: fx.Node, split: fx.Node) -> fx.Node:
    return node_arg(n, 1) if n.args[0] is split else node_arg(n, 0)


def _broadcasts(n: fx.Node, split: fx.Node, d: int) -> bool:
    """The replicated operand of matmul ``n`` has size 1 (or no dim) along output dim ``d``."""
    other = tensor_of(_other(n, split))
    pos = d - (_ndim(n) - other.dim())
    return pos < 0 or other.shape[pos] == 1


def _spans(n: fx.Node, split: fx.Node, d: int) -> int | None:
    """The dim of matmul ``n``'s replicated operand that spans output dim ``d`` whole (as large
    as the split operand's dim there), or None."""
    other = tensor_of(_other(n, split))
    pos = d - (_ndim(n) - other.dim())
    mine = tensor_of(split).shape[d - (_ndim(n) - _ndim(split))]
    if pos < 0 or not isinstance(mine, int) or other.shape[pos] != mine or mine == 1:
        return None
    return pos


def narrowed(n: fx.Node, dims: dict[fx.Node, int]) -> list[tuple[fx.Node, int]]:
    """The replicated operands of split node ``n`` that each rank must cut to its part, with
    the dim to cut (``tensor_parallel._select_heads``): an attention's keys and values when
    only the queries are split (fewer key/value heads than tp), a batched matmul's replicated
    operand that spans the split batch dim (an eager attention's keys or values)."""
    if n.target == aten.scaled_dot_product_attention.default:
        q, k, v = (node_arg(n, i) for i in range(3))
        if q in dims and k not in dims and v not in dims:
            return [(k, _ndim(k) - 3), (v, _ndim(v) - 3)]
    elif n.target in (aten.matmul.default, aten.bmm.default) and n in dims:
        a, b = node_arg(n, 0), node_arg(n, 1)
        if (a in dims) != (b in dims):
            split = a if a in dims else b
            pos = _spans(n, split, dims[n])
            if pos is not None:
                return [(_other(n, split), pos)]
    return []


def _getitem(n, dims):
    return _first(n, dims)


def _sym(x: int | torch.SymInt) -> sympy.Expr:
    return sympy.sympify(x.node.expr) if isinstance(x, torch.SymInt) else sympy.Integer(int(x))


def view_map(n: fx.Node, d: int, grouped: bool = False) -> tuple[int, int]:
    """For a view/reshape of a tensor split along ``d``: (output dim now split, index in the
    output shape list whose literal must be divided by tp; -1 if none). ``grouped``: the
    split dim's leading factor is a count of groups (``qkv.view(b, s, 3, heads, hd)``: q, k
    and v) each split by tp — a strided shard, as for a ``split`` of the split dim — so the
    split lands on the dim after the count."""
    src, out = tensor_of(n.args[0]), tensor_of(n)
    before = sympy.Mul(*[_sym(x) for x in src.shape[:d]])
    size = _sym(src.shape[d])
    acc = sympy.Integer(1)
    for j, o in enumerate(out.shape):
        if sympy.simplify(acc - before) == 0:
            o = _sym(o)
            if grouped:
                if _groups_at(out.shape, j, size):
                    return j + 1, j + 1
                break
            inner_ok = (
                sympy.simplify(size % o) == 0 if o.is_number and size.is_number else o == size
            )
            outer_ok = o.is_number and size.is_number and int(o) % int(size) == 0
            if inner_ok or outer_ok:
                return j, j
            break
        acc = acc * _sym(o)
    raise Illegal(f"view cannot keep dim {d} ({src.shape[d]}) split")


def _groups_at(shape: Any, j: int, size: sympy.Expr) -> bool:
    """``shape[j:j + 3]`` cuts the split dim of ``size`` into groups of heads of a width (``3,
    heads, hd``), all fixed numbers: the count ``shape[j]`` is of groups, not of heads (a
    ``heads, hd`` view is not grouped)."""
    if j + 2 >= len(shape) or not size.is_number:
        return False
    g, heads, width = (_sym(x) for x in shape[j : j + 3])
    return (
        g.is_number
        and heads.is_number
        and width.is_number
        and int(g) > 1
        and int(g) * int(heads) * int(width) == int(size)
    )


def view_groups(n: fx.Node, d: int) -> int | None:
    """The count of groups a view of a tensor split along ``d`` puts the split on, when a
    strided shard could split each group instead (``view_map(..., grouped=True)``), else None."""
    if n.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    try:
        j, _ = view_map(n, d)
        view_map(n, d, grouped=True)
    except Illegal:
        return None
    g = _sym(tensor_of(n).shape[j])
    return int(g) if g.is_number else None


def _view(n, dims):
    return view_map(n, _first(n, dims))[0]


_UNARY_LIKE = frozenset(
    {
        aten.dropout.default,
        aten.to.dtype,
        aten.to.dtype_layout,
        aten._to_copy.default,
        aten.clone.default,
        aten.contiguous.default,
        aten.alias.default,
        aten.detach.default,
        aten.type_as.default,
    }
)

RULES: dict[object, Callable[[fx.Node, dict[fx.Node, int]], int]] = {
    aten.transpose.int: _transpose,
    aten.t.default: lambda n, d: 1 - _first(n, d),
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.expand.default: _expand,
    aten.expand_as.default: _expand_as,
    aten.slice.Tensor: _not_along(1),
    aten.select.int: _not_along(1),
    aten.repeat_interleave.self_int: _repeat_interleave,
    aten.split.Tensor: _split,
    aten.unbind.int: _unbind,
    aten.split_with_sizes.default: _split,
    aten.chunk.default: _split,
    aten.cat.default: _cat,
    aten.stack.default: _stack,
    aten.flatten.using_ints: _flatten,
    aten.softmax.int: _not_along(1),
    aten._softmax.default: _not_along(1),
    aten.log_softmax.int: _not_along(1),
    # running sums, products, log-sum-exps, maxima and minima: each feature on its own
    **dict.fromkeys(
        (
            aten.cumsum.default,
            aten.cumprod.default,
            aten.logcumsumexp.default,
            aten.cummax.default,
            aten.cummin.default,
        ),
        _not_along(1),
    ),
    aten.mean.dim: _reduce,
    aten.sum.dim_IntList: _reduce,
    aten.amax.default: _reduce,
    aten.linalg_vector_norm.default: lambda n, dims: _reduce(n, dims, 2),
    aten.layer_norm.default: _layer_norm,
    aten.rms_norm.default: _layer_norm,
    aten.scaled_dot_product_attention.default: _attention,
    aten.matmul.default: _batched_matmul,
    aten.bmm.default: _batched_matmul,
    aten.view.default: _view,
    aten.reshape.default: _view,
    aten._unsafe_view.default: _view,
    operator.getitem: _getitem,
}


def out_dim(n: fx.Node, dims: dict[fx.Node, int]) -> int:
    """The output dim split after ``n`` (see the module docstring); raises ``Illegal``."""
    if n.target in RULES:
        return RULES[n.target](n, dims)
    tags = getattr(n.target, "tags", ())
    if n.target in _UNARY_LIKE or torch.Tag.pointwise in tags:
        return _pointwise(n, dims)
    raise Illegal(f"no sharding rule for {n.target}")


# -- matmuls with a parameter weight, and the forward spread of a split ----------------------


class Matmul:
    """A matmul whose weight is a 2-D parameter placeholder, in one of the forms export makes.

    ``col_dim``/``row_dim``: the weight dim holding output/input features (``nn.Linear`` stores
    [out, in]; HF ``Conv1D`` and plain ``x @ W`` store [in, out]).
    """

    def __init__(
        self, node: fx.Node, x: fx.Node, weight: fx.Node, bias: fx.Node | None, col_dim: int
    ) -> None:
        self.node, self.x, self.weight, self.bias, self.col_dim = node, x, weight, bias, col_dim
        self.row_dim = 1 - col_dim


def is_param(n: object) -> bool:
    ref = n.meta.get(META_INPUT) if isinstance(n, fx.Node) else None
    return ref is not None and ref.kind == "param"


def matmul_form(n: fx.Node) -> Matmul | None:
    if n.op != "call_function":
        return None
    a = n.args
    if n.target == aten.linear.default and is_param(a[1]) and tensor_of(a[1]).dim() == 2:
        return Matmul(n, node_arg(n, 0), node_arg(n, 1), optional_node_arg(n, 2), 0)
    if (
        n.target == aten.addmm.default
        and is_param(a[2])
        and tensor_of(a[2]).dim() == 2
        and len(a) == 3
        and not n.kwargs
    ):
        return Matmul(n, node_arg(n, 1), node_arg(n, 2), node_arg(n, 0), 1)
    if (
        n.target in (aten.mm.default, aten.matmul.default)
        and is_param(a[1])
        and tensor_of(a[1]).dim() == 2
    ):
        return Matmul(n, node_arg(n, 0), node_arg(n, 1), None, 1)
    return None


class Spread:
    """Where a split spreads from its seed matmuls, and what stops it.

    ``dims``: node → split output dim; ``columns``: seed matmuls (output features split);
    ``rows``: matmuls whose input features arrive split; ``ends``: other accepted terminals;
    ``problems``: node → why the split cannot pass it. ``component(n)`` groups all of these into
    connected regions.
    """

    def __init__(self) -> None:
        self.dims: dict[fx.Node, int] = {}
        self.columns: list[fx.Node] = []
        self.rows: list[fx.Node] = []
        self.ends: list[fx.Node] = []
        self.problems: dict[fx.Node, str] = {}
        self._parent: dict[fx.Node, fx.Node] = {}

    def _find(self, n: fx.Node) -> fx.Node:
        while self._parent.setdefault(n, n) is not n:
            n = self._parent[n]
        return n

    def join(self, a: fx.Node, b: fx.Node) -> None:
        self._parent[self._find(a)] = self._find(b)

    def components(self) -> dict[fx.Node, list[fx.Node]]:
        groups: dict[fx.Node, list[fx.Node]] = {}
        for n in [*self.dims, *self.rows, *self.ends, *self.problems]:
            groups.setdefault(self._find(n), [])
            if n not in groups[self._find(n)]:
                groups[self._find(n)].append(n)
        return groups


def spread(
    gm: fx.GraphModule,
    column: Callable[[Matmul], bool],
    end: Callable[[fx.Node, dict[fx.Node, int]], bool] = lambda n, d: False,
    grouped: Collection[fx.Node] = (),
) -> Spread:
    """Split the output features of every matmul ``column`` accepts; follow the split forward
    (through the views in ``grouped`` as ``view_map(..., grouped=True)``)."""
    sp = Spread()
    for n in gm.graph.nodes:
        split_in = [a for a in n.all_input_nodes if a in sp.dims]
        for a in split_in[1:]:
            sp.join(split_in[0], a)
        if n.op == "output":
            if split_in:
                sp.problems[n] = "a split value reaches the graph output"
                sp.join(n, split_in[0])
            continue
        if n.op != "call_function":
            continue
        form = matmul_form(n)
        if form is not None and form.x in sp.dims:
            if sp.dims[form.x] == tensor_of(form.x).dim() - 1 and form.weight not in sp.dims:
                sp.rows.append(n)
            else:
                sp.problems[n] = "matmul input split along a non-feature dim"
            sp.join(n, form.x)
            continue
        if form is not None and not split_in:
            if column(form):
                sp.dims[n] = tensor_of(n).dim() - 1
                sp.columns.append(n)
                sp._find(n)
            continue
        if not split_in:
            continue
        sp.join(n, split_in[0])
        if end(n, sp.dims):
            sp.ends.append(n)
        elif n.target == aten.sym_size.int:
            if _norm(n.args[1], _ndim(n.args[0])) == sp.dims[n.args[0]]:
                sp.problems[n] = "reads the size of the split dim"
        elif n.target == aten._assert_tensor_metadata.default:
            continue
        else:
            try:
                if n in grouped:
                    sp.dims[n] = view_map(n, sp.dims[node_arg(n, 0)], grouped=True)[0]
                else:
                    sp.dims[n] = out_dim(n, sp.dims)
            except Illegal as exc:
                sp.problems[n] = str(exc)
    return sp
