"""Loops over the tokens: a graph torch.export unrolled at the example's length, rolled back up.

A model that loops over its tokens in Python (Hugging Face Mamba's and Jamba's selective scan:
``for i in range(seq_len): h = dA[:, :, i] * h + dBu[:, :, i]; y.append(h @ C[:, i])``) is
captured with the loop unrolled, once per token of the example, and export fixes the length
of ``input_ids``: the graph fits that length only, and Seq1F1B cannot cut it. ``reroll`` finds
such loops and writes them for any length:

- **the recurrence**: a chain ``h_i = a_i · h_{i−1} + b_i`` over i = 0 … S − 1 (S the fixed
  length), started from zeros, where ``a_i`` and ``b_i`` are ``select(A, d, i)`` and
  ``select(B, d, i)`` of the same two tensors along a dim of length S, becomes one
  ``autopart::linear_scan(A, B, d)`` (``autopart/scan.py``), whose entry i is ``h_i``;
- **the per-token work**: a ``stack`` of S values, the i-th computed from entry i of tensors
  laid out along the sequence (and from values shared by every token) by the same nodes for
  every i, becomes those nodes once, vectorized over the sequence (``torch.func.vmap``, traced
  to ATen with a symbolic length);
- a slice ``x[..., :S]`` of a dim that grows with the sequence becomes a slice to the length
  (Mamba's convolution cut back to the sequence), and whole slices ``x[0:END]`` go.

The batch inputs then take the length of the labels (still symbolic), and shapes are propagated
again. Anything left reading a fixed token, or mixing two tokens' work, fails it (the graph
stays as export made it, and Seq1F1B refuses it, naming the fixed length). ``capture`` keeps
the rolled graph only when it computes the model's loss at the example's length and at two
others (``autopart.frontend.capture.generalize_loops``).
"""

from __future__ import annotations

import operator
from typing import Any, cast

import sympy
import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges

import autopart.scan  # noqa: F401 - registers autopart::linear_scan
from autopart.errors import first_line
from autopart.frontend.shapes import propagate, static_size
from autopart.graph import copy_graph, remove_dead
from autopart.meta import META_INPUT, META_LAYER, META_MODULE, META_RANGES
from autopart.node_args import int_arg, node_arg

aten = torch.ops.aten
END = 2**63 - 1
DYNAMIC = DimDynamic.DYNAMIC
_CASTS = (aten.to.dtype, aten._to_copy.default)
_ZEROS = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)
_EXPAND = aten.expand.default
_SIZED = (aten.reshape.default, aten._unsafe_view.default, _EXPAND)
_FACTORIES = (aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format)


def fixed_length(gm: fx.GraphModule) -> int | None:
    """The length export fixed ``input_ids``' sequence dim to, or None if it is symbolic."""
    for n in gm.graph.nodes:
        ref = n.meta.get(META_INPUT)
        if n.op == "placeholder" and ref is not None and ref.name == "input_ids":
            return static_size(n.meta["val"].shape[1])
    return None


def reroll(gm: fx.GraphModule, length: int, tables: bool = False) -> fx.GraphModule | str:
    """A copy of ``gm`` with its loops over ``length`` tokens rolled up (module docstring), or
    why not. ``tables``: a slice ``buf[..., :length]`` of a buffer longer than that is cut to
    the length too (nanoGPT's mask); only where no width of the model is ``length`` (capture's
    second try, at a free length), since a model's ``scale[:width]`` would otherwise be read
    as the length, and three lengths need not tell (a max of a table's first entries)."""
    out = copy_graph(gm)  # its meta included
    g = out.graph
    chains = _recurrences(g, length)
    if not chains:
        return "it is no loop over the tokens that autopart recognizes"
    s = _symbolic_length(gm)
    if s is None:  # the labels' length was fixed too: a fresh symbol for both
        from torch._dynamo.source import ConstantSource  # 1.2 s to import: only when needed

        env = _fake_mode(g).shape_env
        sym = env.create_symbol(length, ConstantSource("autopart_seq"), dynamic_dim=DYNAMIC)
        s = env.create_symintnode(sym, hint=length)
        out.meta[META_RANGES] = {**gm.meta.get(META_RANGES, {}), sym: ValueRanges(2, int_oo)}
    for chain, (a, b, dim) in chains:
        _scan(g, chain, a, b, dim)
    for last, values, dim in _collectors(g, length):
        with g.inserting_after(last):
            stacked = g.call_function(aten.stack.default, (values, dim))
        stacked.meta["val"] = last.meta["val"]
        _place(stacked, last)
        last.replace_all_uses_with(stacked)
    remove_dead(out)
    for st in [n for n in g.nodes if n.target == aten.stack.default]:
        tags = _iterations(g, length)  # a stack rolled up frees what follows it of its tokens
        ys = st.args[0]
        if len(ys) == length and all(tags.get(y) == i for i, y in enumerate(ys)):
            why = _vectorize(out, st, tags, s)
            if why:
                return why
            remove_dead(out)
    tags = _iterations(g, length)
    left = next((n for n in g.nodes if n in tags), None)
    if left is not None:
        return f"node {left.name} ({left.meta.get(META_MODULE) or '<root>'}) reads " + (
            f"token {tags[left]} alone" if tags[left] >= 0 else "several tokens' work"
        )
    for n in list(g.nodes):  # whole slices (x[:, :, :S] left x[0:END] before the cut): x
        if n.target == aten.slice.Tensor and _base(n) is not n:
            n.replace_all_uses_with(_base(n))
    remove_dead(out)
    mode = _fake_mode(g)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    ids = next(n for n in placeholders if n.meta[META_INPUT].name == "input_ids")
    with g.inserting_after(placeholders[-1]):
        size = g.call_function(aten.sym_size.int, (ids, 1))
    for n in placeholders:
        ref = n.meta[META_INPUT]
        val = n.meta["val"]
        if ref.kind == "data" and val.dim() >= 2 and static_size(val.shape[1]) == length:
            with mode:
                n.meta["val"] = torch.empty(
                    (val.shape[0], s, *val.shape[2:]), dtype=val.dtype, device=val.device
                )
    inputs = [n.meta["val"] for n in placeholders]
    for n in g.nodes:  # views of values the rolled-up work lays out otherwise: reshapes
        if n.target == aten.view.default:
            n.target = aten.reshape.default
    try:
        with mode:
            _Ends(out, length, size, s, tables).run(*inputs)
        propagate(out)
    except Exception as exc:  # noqa: BLE001 - the rolled graph does not fit a symbolic length
        first = first_line(exc)
        return f"the rolled graph does not fit other lengths ({first[:200]})"
    g.lint()
    out.recompile()
    return out


def _fake_mode(g: fx.Graph) -> Any:
    """The fake mode export's values live in."""
    mode = detect_fake_mode([n.meta["val"] for n in g.nodes if n.op == "placeholder"])
    assert mode is not None  # export's graphs carry fake values
    return mode


def _symbolic_length(gm: fx.GraphModule) -> torch.SymInt | None:
    """The symbolic sequence length of a batch input export kept symbolic (the labels', when
    only the loss compares them with the logits), or None."""
    for n in gm.graph.nodes:
        ref = n.meta.get(META_INPUT)
        if n.op == "placeholder" and ref is not None and ref.kind == "data":
            val = n.meta["val"]
            dim = val.shape[1] if val.dim() >= 2 else None
            if isinstance(dim, torch.SymInt) and dim.node.expr.is_Symbol:
                return dim
    return None


def _base(n: Any) -> Any:
    """``n`` with whole slices (``x[0:END]``) looked through."""
    while isinstance(n, fx.Node) and n.target == aten.slice.Tensor:
        start, end, step = (list(n.args[2:5]) + [None, END, 1][len(n.args) - 2 :])[:3]
        if start not in (0, None) or step != 1 or not (end is None or isinstance(end, int)):
            break
        if end is not None and end < END:
            break
        n = n.args[0]
    return n


def _token(n: Any, length: int) -> tuple[fx.Node, int, int] | None:
    """(tensor, dim, i) when ``n`` is ``select(tensor, dim, i)`` of a dim of ``length``."""
    if not isinstance(n, fx.Node) or n.target != aten.select.int:
        return None
    x, dim, i = _base(n.args[0]), n.args[1], n.args[2]
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(dim, int):
        return None
    dim %= val.dim()
    if static_size(val.shape[dim]) != length or not isinstance(i, int) or not 0 <= i < length:
        return None
    return x, dim, i


def _same(n: fx.Node) -> fx.Node:
    """``n`` with casts to its own dtype (identities) looked through."""
    while n.target in _CASTS and n.meta["val"].dtype == node_arg(n, 0).meta["val"].dtype:
        n = node_arg(n, 0)
    return n


def _cast_token(n: Any, length: int) -> tuple[fx.Node, int, int, Any] | None:
    """(tensor, dim, i, dtype) when ``n`` is ``select(tensor, dim, i)`` of a dim of ``length``,
    cast to ``dtype`` (RecurrentGemma's ``gate[:, t].type(float32)``) or not (None)."""
    dtype = None
    if isinstance(n, fx.Node) and n.target in _CASTS:
        dtype, n = n.meta["val"].dtype, n.args[0]
    tok = _token(n, length)
    return None if tok is None else (*tok, dtype)


def _step(n: fx.Node, length: int) -> tuple[Any, Any, fx.Node] | None:
    """(a_i token, b_i token, h) when ``n`` is ``a_i · h + b_i`` (either order; each token
    perhaps cast, ``_cast_token``)."""
    if n.target != aten.add.Tensor or len(n.args) != 2 or n.kwargs.get("alpha", 1) != 1:
        return None
    for prod, other in (n.args, n.args[::-1]):
        if not isinstance(prod, fx.Node) or prod.target != aten.mul.Tensor:
            continue
        b = _cast_token(other, length)
        for x, h in (prod.args, prod.args[::-1]):
            a = _cast_token(x, length)
            if (
                a is not None
                and b is not None
                and isinstance(h, fx.Node)
                and a[1:3] == b[1:3]
                and (a[3] or a[0].meta["val"].dtype) == (b[3] or b[0].meta["val"].dtype)
                and a[0].meta["val"].shape == b[0].meta["val"].shape
            ):
                return a, b, _same(h)
    return None


def _recurrences(g: fx.Graph, length: int) -> list[tuple[list[fx.Node], tuple]]:
    """Each chain h_0 … h_{length−1} of linear steps from zeros, over the same a and b."""
    steps = {n: st for n in g.nodes if (st := _step(n, length)) is not None}
    after = {h: n for n, (_, _, h) in steps.items()}
    chains = []
    for n, (a, b, h) in steps.items():
        if h.target not in _ZEROS or a[2] != 0:
            continue
        chain = [n]
        while chain[-1] in after and len(chain) < length:
            chain.append(after[chain[-1]])
        ok = len(chain) == length and all(
            steps[c][0] == (a[0], a[1], i, a[3]) and steps[c][1] == (b[0], b[1], i, b[3])
            for i, c in enumerate(chain)
        )
        zero = h.meta["val"].shape == a[0].meta["val"].select(a[1], 0).shape
        if ok and zero:
            chains.append((chain, ((a[0], a[3]), (b[0], b[3]), a[1])))
    return chains


def _written(n: fx.Node) -> tuple[fx.Node, fx.Node, int, Any] | None:
    """(into, value, dim, i) when ``n`` is ``into`` with its entry i along dim replaced by
    ``value``: ``select_scatter(into, value, dim, i)``, or such a write into a whole slice of
    ``into`` scattered back over all of it (``out[:, t] = h``: a slice along dim 0, then the
    select)."""
    if n.target == aten.select_scatter.default:
        into, value, dim, i = n.args[:4]
        if not isinstance(into, fx.Node) or not isinstance(value, fx.Node):
            return None
        return _base(into), value, int(cast(int, dim)) % into.meta["val"].dim(), cast(int, i)
    if n.target != aten.slice_scatter.default or not isinstance(n.args[1], fx.Node):
        return None
    start, end, step = (list(n.args[3:6]) + [None, None, 1][len(n.args) - 3 :])[:3]
    inner = _written(n.args[1])
    whole = start in (0, None) and step == 1 and (end is None or end == END)
    if not whole or inner is None or _base(inner[0]) is not n.args[0]:
        return None
    return cast(fx.Node, n.args[0]), inner[1], inner[2], inner[3]


def _collectors(g: fx.Graph, length: int) -> list[tuple[fx.Node, list[fx.Node], int]]:
    """Each chain writing entries 0, 1, …, length − 1 along a dim of ``length``, one by one,
    into the same tensor (RecurrentGemma's ``out[:, t] = h``): (its last write, the values
    written, the dim). The last write equals ``stack(values, dim)``: every entry is
    overwritten, so what the tensor held before does not matter."""
    writes = {n: w for n in g.nodes if (w := _written(n)) is not None}
    for n in [n for n in writes if n.target == aten.slice_scatter.default]:
        writes.pop(cast(fx.Node, n.args[1]), None)  # the select_scatter it scatters back
    into: dict[fx.Node, list[fx.Node]] = {}
    for n, (x, _, _, _) in writes.items():
        into.setdefault(x, []).append(n)
    found = []
    for n, (x, _, dim, i) in writes.items():
        if i != 0 or static_size(x.meta["val"].shape[dim]) != length:
            continue
        chain = [n]
        while len(chain) < length:
            t = len(chain)
            nxt = [w for w in into.get(chain[-1], []) if writes[w][2:] == (dim, t)]
            if len(nxt) != 1:
                break
            chain.append(nxt[0])
        values = [writes[w][1] for w in chain]
        same = all(v.meta["val"].dtype == x.meta["val"].dtype for v in values)
        if len(chain) == length and same:
            found.append((chain[-1], values, dim))
    return found


def _scan(g: fx.Graph, chain: list[fx.Node], a: tuple, b: tuple, dim: int) -> None:
    """The chain replaced by one ``linear_scan`` of ``a`` and ``b`` (each a tensor and the
    dtype its tokens were cast to, or None), and a select of it per step."""
    made = []
    with g.inserting_before(chain[0]):
        x, y = (
            t if dtype is None else g.call_function(aten._to_copy.default, (t,), {"dtype": dtype})
            for t, dtype in (a, b)
        )
        made += [m for m, (t, _) in zip((x, y), (a, b), strict=True) if m is not t]
        h = g.call_function(torch.ops.autopart.linear_scan.default, (x, y, dim))
    for m, (t, dtype) in zip((x, y), (a, b), strict=True):
        if m is not t:
            m.meta["val"] = t.meta["val"].to(dtype)
    h.meta["val"] = torch.ops.autopart.linear_scan(x.meta["val"], y.meta["val"], dim)
    for m in (*made, h):
        _place(m, chain[0])
    for i, n in enumerate(chain):
        with g.inserting_after(h):
            each = g.call_function(aten.select.int, (h, dim, i))
        each.meta["val"] = n.meta["val"]
        _place(each, n)
        n.replace_all_uses_with(each)


def _place(n: fx.Node, like: fx.Node) -> None:
    n.meta[META_MODULE], n.meta[META_LAYER] = (
        like.meta.get(META_MODULE, ""),
        like.meta.get(META_LAYER),
    )


def _iterations(g: fx.Graph, length: int) -> dict[fx.Node, int]:
    """Node → the token whose work it is (-1: several tokens'): a select of token i of a
    value laid out along the sequence is token i's, and so is what only it feeds."""
    tags: dict[fx.Node, int] = {}
    for n in g.nodes:
        if n.op != "call_function":
            continue
        seen = {tags[a] for a in n.all_input_nodes if a in tags}
        tok = _token(n, length) if not seen else None
        if tok is not None and tok[0] not in tags:
            tags[n] = tok[2]
        elif seen:
            tags[n] = seen.pop() if len(seen) == 1 else -1
    return tags


def _body(y: fx.Node, i: int, tags: dict[fx.Node, int], order: dict[fx.Node, int]) -> list:
    out, stack, seen = [], [y], set()
    while stack:
        n = stack.pop()
        if n in seen or tags.get(n) != i:
            continue
        seen.add(n)
        out.append(n)
        stack.extend(n.all_input_nodes)
    return sorted(out, key=order.__getitem__)


def _vectorize(gm: fx.GraphModule, st: fx.Node, tags: dict, s: torch.SymInt) -> str | None:
    """Replace ``stack([y_0 … y_{S−1}], dim)`` by token 0's nodes mapped over the sequence."""
    g = gm.graph
    order = {n: k for k, n in enumerate(g.nodes)}
    ys = list(cast("list[fx.Node]", st.args[0]))
    bodies = [_body(y, i, tags, order) for i, y in enumerate(ys)]
    first = bodies[0]
    inside = set(first)
    leaves = [n for n in first if n.target == aten.select.int and n.args[0] not in inside]
    outside: list[fx.Node] = []
    for n in first:
        for a in n.all_input_nodes:
            if a not in inside and a not in outside and not any(a is lf.args[0] for lf in leaves):
                outside.append(a)
    for i, body in enumerate(bodies[1:], 1):
        if not _isomorphic(first, body, i):
            return f"token {i}'s work in {st.name} is not token 0's"
    dims = [int(lf.args[1]) % _base(lf.args[0]).meta["val"].dim() for lf in leaves]
    bases = [_base(lf.args[0]) for lf in leaves]

    def one(*args: Any) -> Any:
        env: dict[fx.Node, Any] = dict(zip(leaves + outside, args, strict=True))
        for n in first:
            if n not in env:
                env[n] = n.target(
                    *fx.node.map_arg(n.args, env.__getitem__),
                    **fx.node.map_arg(n.kwargs, env.__getitem__),
                )
        return env[ys[0]]

    mode = _fake_mode(g)
    with mode:
        vals = [
            torch.empty(
                [s if k == d else x for k, x in enumerate(b.meta["val"].shape)],
                dtype=b.meta["val"].dtype,
                device=b.meta["val"].device,
            )
            for b, d in zip(bases, dims, strict=True)
        ] + [n.meta["val"] for n in outside]
        out_dim = int_arg(st, 1, "dim", 0) % st.meta["val"].dim()
        mapped = torch.func.vmap(one, in_dims=(*dims, *([None] * len(outside))), out_dims=out_dim)
        try:
            traced = make_fx(mapped)(*vals)
        except Exception as exc:  # noqa: BLE001 - not every op maps over a dim
            return f"token 0's work in {st.name} does not map over the sequence ({exc})"
    env = dict(
        zip(
            [n for n in traced.graph.nodes if n.op == "placeholder"],
            bases + outside,
            strict=True,
        )
    )
    with g.inserting_before(st):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                st.replace_all_uses_with(env[n.args[0]])
                break
            env[n] = g.node_copy(n, env.__getitem__)
            _place(env[n], st)
    return None


def _isomorphic(first: list[fx.Node], body: list[fx.Node], i: int) -> bool:
    """``body`` (token i's nodes) is ``first`` (token 0's) with token i selected for token 0."""
    if len(first) != len(body):
        return False
    pair = dict(zip(first, body, strict=True))

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, fx.Node):
            return pair.get(x, x) is y
        if isinstance(x, (list, tuple)):
            return (
                isinstance(y, (list, tuple))
                and len(x) == len(y)
                and all(same(u, v) for u, v in zip(x, y, strict=True))
            )
        return type(x) is type(y) and x == y

    for a, b in zip(first, body, strict=True):
        if a.target != b.target or len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
            return False
        args = list(zip(a.args, b.args, strict=True))
        if a.target == aten.select.int and a.args[0] not in pair:  # a leaf: token 0 → token i
            if (a.args[2], b.args[2]) != (0, i) or _base(a.args[0]) is not _base(b.args[0]):
                return False
            args = args[1:2]
        if not all(same(x, y) for x, y in args):
            return False
        if not all(same(a.kwargs[k], b.kwargs[k]) for k in a.kwargs):
            return False
    return True


class _Ends(fx.Interpreter):
    """Fake propagation that reads the fixed length S as the length where the model meant it,
    rewriting it to the graph's length node: the end of a slice ``x[..., :S]`` of a dim that now
    grows with the sequence (Mamba's convolution cut back to the length) or, with ``tables``,
    of a buffer's dim longer than S (nanoGPT's causal mask ``bias[:, :, :T, :T]``), ``arange(S)`` (the
    positions), S in a factory's sizes, in an expand's where the input's dim is the length, in a
    view's where the element count needs it, and k·S in a product of sizes (``b · k·S``: the
    batch and the length, k slots per token, flattened together). Where S is also a width of the model, a
    guess can be wrong; ``capture`` then tries again at a length no size of the graph has."""

    def __init__(
        self, gm: fx.GraphModule, length: int, size: fx.Node, s: torch.SymInt, tables: bool
    ) -> None:
        super().__init__(gm)
        self.length, self.size, self.s, self.tables = length, size, s, tables

    def run_node(self, n: fx.Node) -> Any:
        if n.target == aten.slice.Tensor and len(n.args) >= 4 and n.args[3] == self.length:
            x, dim, start = node_arg(n, 0), int_arg(n, 1), n.args[2]
            step = n.args[4] if len(n.args) > 4 else 1
            grows = self.env[x].shape[dim]
            symbols = self.s.node.expr.free_symbols
            if (
                start in (0, None)
                and step == 1
                and (
                    (isinstance(grows, torch.SymInt) and symbols <= grows.node.expr.free_symbols)
                    or (
                        self.tables and isinstance(grows, int) and grows > self.length and _table(x)
                    )
                )
            ):
                n.args = (x, dim, start, self.size, *n.args[4:])
        elif n.target == aten.arange.default and n.args[:1] == (self.length,):
            n.args = (self.size, *n.args[1:])  # positions over the sequence
        elif n.target in _FACTORIES and isinstance(n.args[0], (list, tuple)):
            if self.length in n.args[0]:
                n.args = ([self.size if v == self.length else v for v in n.args[0]], *n.args[1:])
        elif n.target == operator.mul and len(n.args) == 2 and any(map(self._times, n.args)):
            # d · k·S: the batch and the length (and k slots per token) flattened together
            k = next(i for i, a in enumerate(n.args) if self._times(a))
            times, size = cast(int, n.args[k]) // self.length, self.size
            if times != 1:
                with n.graph.inserting_before(n):
                    size = n.graph.call_function(operator.mul, (self.size, times))
                size.meta["val"] = self.env[size] = self.s * times
            n.args = (size, n.args[1]) if k == 0 else (n.args[0], size)
        elif n.target in _SIZED and isinstance(n.args[1], (list, tuple)):
            sizes = list(n.args[1])
            if self.length in sizes:
                picked = self._sizes(self.env[node_arg(n, 0)], sizes, n.target == _EXPAND)
                if picked is not None:
                    n.args = (n.args[0], picked, *n.args[2:])
        return super().run_node(n)

    def _times(self, a: Any) -> bool:
        """``a`` is a literal multiple of the fixed length."""
        return isinstance(a, int) and not isinstance(a, bool) and a > 0 and a % self.length == 0

    def _sizes(self, x: torch.Tensor, sizes: list, expand: bool) -> list | None:
        """``sizes`` (a view's or an expand's, with S written for the length) with the entries
        that are the length pointing at the length node: for an expand, where ``x``'s dim is
        the length; for a view, the first entry (else all of them) whose replacement keeps the
        element count (symbolically, ``-1`` taking the rest)."""
        s = self.s.node.expr
        if expand:
            shape = [None] * (len(sizes) - x.dim()) + list(x.shape)
            out = [
                self.size
                if v == self.length and isinstance(d, torch.SymInt) and d.node.expr == s
                else v
                for v, d in zip(sizes, shape, strict=True)
            ]
            return out if out != sizes else None
        numel = sympy.Mul(*(_expr(d) for d in x.shape))
        if s not in numel.free_symbols:
            return None
        where = [k for k, v in enumerate(sizes) if v == self.length]
        for pick in [*([k] for k in where), where]:
            out = [self.size if k in pick else v for k, v in enumerate(sizes)]
            known = sympy.Mul(
                *(s if k in pick else _expr(v) for k, v in enumerate(sizes) if v != -1)
            )
            rest = sympy.cancel(numel / known)
            if (
                -1 in sizes and rest.is_polynomial() and not rest.free_symbols - numel.free_symbols
            ) or (-1 not in sizes and rest == 1):
                return out
        return None


def _table(x: fx.Node) -> bool:
    """``x`` is a buffer or a constant, or slices of one: a table longer than the sequence,
    which a model cuts to the length (nanoGPT's causal mask ``bias[:, :, :T, :T]``)."""
    while x.target == aten.slice.Tensor:
        x = node_arg(x, 0)
    ref = x.meta.get(META_INPUT)
    return x.op == "placeholder" and ref is not None and ref.kind in ("buffer", "constant")


def _expr(d: Any) -> Any:
    """A size as a sympy expression (an fx node: its value's)."""
    if isinstance(d, fx.Node):
        d = d.meta["val"]
    return d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(int(d))
