"""position_masks: attention masks and biases that are functions of positions, rebuilt where
the attention is and proven causal by evaluation (a helper of ``canonicalize_attention``).

Invariant of ``local_mask``: the mask it returns is computed, next to the attention, from the
sizes of the attention's own queries and keys (and buffers) only: the key length ``Lk`` read
from ``k`` (every size of the original construction that was the sequence length), the query
rows then cut to the last ``Lq`` (rows and columns are positions 0 … Lk − 1, and the queries
are the last Lq of them). Unchunked, Lq = Lk = s and it equals the model's own mask; for a
Seq1F1B chunk the chunk pass points its key-length sizes at [prefix; chunk], and the mask is
the rows of the chunk's queries over every key they may see, at absolute positions. Each node
made is marked ``meta["autopart.mask_fn"]`` ("keys" on the key-length sizes), so the chunk
pass neither shifts its positions nor drops it.

``prove`` is the condition under which that is exact. The mask is evaluated at several
sequence lengths (every size substituted), and must, at every length:

- keep every query's own key and hide every later key (additive: ≤ ``MASKED`` or −inf;
  boolean: False where ``keep_is_true``): a chunk's queries never see a later chunk's keys;
- equal the longer lengths' mask on their first rows and columns (additive: up to one constant
  per row, which softmax ignores: MPT's ALiBi is slope · (j − s + 1)): the mask of a shorter
  sequence is the top-left corner of a longer one's, so a position function of (i, j).

``prove_scores`` is the same condition for a score function f (``canonicalize_attention``'s
general form): f is evaluated on random scores (and a random sink column), and its output must
hide later keys, keep each query's own, and agree with the longer length's on the first rows
and columns up to one constant per row (the sink column included).

Anything else is refused by the caller, with the reason returned here.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
from torch import fx

from autopart.frontend.capture import B, S, to_sympy
from autopart.meta import META_BUFFERS, META_INPUT, META_LAYER, META_MASK_FN, META_MODULE

aten = torch.ops.aten
# An additive entry at or below MASKED hides its key: the model's own softmax weight there,
# exp(entry - row max), is exactly 0 (it underflows) in float64 whenever the row's largest score
# is above MASKED + 746 (float32 and bfloat16: + 104), i.e. unless the query's own key scores
# below -9254. GPT-1's and BERT-era masks of -1e4 and the float minimum both qualify.
MASKED = -1e4
LENGTHS = (3, 5, 8, 13, 21)
LONGEST = 8192
_END = 9223372036854775807


def construction(
    root: fx.Node, given: frozenset[fx.Node] = frozenset()
) -> tuple[list[fx.Node], list[fx.Node], str | None]:
    """The nodes computing ``root`` from sizes and buffers (and the ``given`` nodes), in graph
    order, and its size leaves (``sym_size`` calls: where the construction reads a length); or
    why it is not one (it reads a parameter, or a tensor's values that are not a buffer's)."""
    need: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in need or n in leaves or n in given:
            continue
        if n.target == aten.sym_size.int:
            leaves.add(n)
            continue
        if n.op == "placeholder":
            ref = n.meta.get(META_INPUT)
            if ref is None or ref.kind not in ("buffer", "constant"):
                what = f"the {ref.kind} {ref.name}" if ref is not None else n.name
                return [], [], f"its construction reads {what}"
        elif n.op != "call_function":
            return [], [], f"its construction reads {n.name}"
        need.add(n)
        stack.extend(n.all_input_nodes)
    order = [n for n in root.graph.nodes if n in need]
    return order, [n for n in root.graph.nodes if n in leaves], None


def local_mask(
    gm: fx.GraphModule,
    root: fx.Node,
    q: fx.Node,
    k: fx.Node,
    before: fx.Node,
    replace: dict[fx.Node, fx.Node] | None = None,
) -> fx.Node | str:
    """A copy of ``root``'s construction before ``before``, its sizes read from ``q`` and ``k``
    ([b, h, L, d]) and its rows cut to the last Lq (module docstring); or why it cannot be.
    ``replace``: nodes of the construction to take as given (already copied)."""
    order, leaves, why = construction(root, frozenset(replace or ()))
    if why:
        return why
    g = gm.graph
    env: dict[fx.Node, Any] = dict(replace or {})
    made: list[fx.Node] = []
    sizes: dict[str, fx.Node] = {}

    def size(of: fx.Node, dim: int, key: str) -> fx.Node:
        if key not in sizes:
            sizes[key] = sym_size(g, of, dim, "keys" if key == "lk" else True)
            made.append(sizes[key])
        return sizes[key]

    with g.inserting_before(before):
        for leaf in leaves:
            expr = to_sympy(leaf.meta["val"], gm)
            value = _size_of(expr, size, q, k, gm)
            if value is None:
                _erase(g, made)
                return f"its construction uses the size {expr}, not a batch or sequence length"
            env[leaf] = value
        for n in order:
            if n in env:
                continue
            if n.op == "placeholder":  # a buffer: read where it is
                env[n] = n
                continue
            env[n] = g.node_copy(n, lambda a: env[a])
            env[n].meta[META_MASK_FN] = True
            made.append(env[n])
        mask = env[root]
        val = root.meta["val"]
        if val.dim() >= 2 and to_sympy(val.shape[-2], gm) == S:  # query rows: the last Lq
            lq, lk = size(q, -2, "lq"), size(k, -2, "lk")
            start = g.call_function(operator.sub, (lk, lq))
            mask = g.call_function(aten.slice.Tensor, (mask, -2, start, _END))
            made += [start, mask]
            start.meta[META_MASK_FN] = mask.meta[META_MASK_FN] = True
    place(made, before)
    return mask


def place(made: list[fx.Node], at: fx.Node) -> None:
    """Give nodes made for ``at`` its module and block (copies carried the originals')."""
    for n in made:
        n.meta[META_MODULE], n.meta[META_LAYER] = (
            at.meta.get(META_MODULE, ""),
            at.meta.get(META_LAYER),
        )


def sym_size(g: fx.Graph, x: fx.Node, dim: int, mark: object = True) -> fx.Node:
    """``aten.sym_size.int(x, dim)`` with its value, marked ``META_MASK_FN`` = ``mark``."""
    n = g.call_function(aten.sym_size.int, (x, dim))
    n.meta["val"] = x.meta["val"].shape[dim]
    n.meta[META_MASK_FN] = mark
    return n


def _size_of(expr: sympy.Expr, size, q: fx.Node, k: fx.Node, gm: fx.GraphModule) -> Any:
    """A size expression of the original construction, in terms of q's and k's sizes: the
    sequence length is k's length; a multiple of the batch plus a constant, q's batch."""
    if expr == S:
        return size(k, -2, "lk")
    if expr.free_symbols - {B}:
        return None
    poly = sympy.Poly(expr, B)
    if poly.degree() > 1:
        return None
    a, c = int(poly.coeff_monomial(B)), int(poly.coeff_monomial(1))
    if a == 0:
        return c
    if to_sympy(q.meta["val"].shape[0], gm) != B:
        return None
    out: Any = size(q, 0, "b")
    if a != 1:
        out = q.graph.call_function(operator.mul, (out, a))
        out.meta[META_MASK_FN] = True
    if c:
        out = q.graph.call_function(operator.add, (out, c))
        out.meta[META_MASK_FN] = True
    return out


def _erase(g: fx.Graph, made: list[fx.Node]) -> None:
    for n in reversed(made):
        if not n.users:
            g.erase_node(n)


def discard(gm: fx.GraphModule, mask: fx.Node) -> None:
    """Remove a rebuilt mask that was not proven (and every node made for it)."""
    stack, gone = [mask], set()
    while stack:
        n = stack.pop()
        if n in gone or not n.meta.get(META_MASK_FN) or n.users or n.op != "call_function":
            continue
        stack.extend(n.all_input_nodes)
        gm.graph.erase_node(n)
        gone.add(n)


def _evaluator(
    gm: fx.GraphModule, root: fx.Node, inputs: list[fx.Node], leaves: list[fx.Node], order: list
) -> fx.GraphModule:
    """``root``'s construction as a module to run on the CPU: its arguments are ``inputs``,
    then the size ``leaves``, then the buffers ``order`` reads."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in (*inputs, *leaves):
        env[n] = sub.placeholder(n.name)
    for n in order:
        if n.op == "placeholder":
            env[n] = sub.placeholder(n.name)
        else:
            env[n] = _copy_for_evaluation(sub, n, env)
    sub.output(env[root])
    return fx.GraphModule(gm, sub)


def _copy_for_evaluation(sub: fx.Graph, n: fx.Node, env: dict[fx.Node, fx.Node]) -> fx.Node:
    """``n`` copied into ``sub`` to run on the CPU, a factory given the dtype the capture saw
    (``full([], finfo(float64).min)`` has none: under float32 defaults it overflows)."""
    out = sub.node_copy(n, lambda a: env[a])
    kwargs = dict(n.kwargs)
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    val = n.meta.get("val")
    if n.target in _FACTORIES and "dtype" not in kwargs and isinstance(val, torch.Tensor):
        kwargs["dtype"] = val.dtype
    out.kwargs = kwargs
    return out


_FACTORIES = (aten.full.default, aten.zeros.default, aten.ones.default, aten.scalar_tensor.default)


def prove(
    gm: fx.GraphModule, mask: fx.Node, additive: bool, keep_is_true: bool = True
) -> str | None:
    """None if the rebuilt ``mask`` is a causal position function (module docstring), else
    why not. Boolean masks keep where True when ``keep_is_true``; additive ones are added to
    the scores."""
    order, leaves, why = construction(mask)
    if why:
        return why
    run = _evaluator(gm, mask, [], leaves, order)
    buffers = gm.meta.get(META_BUFFERS, {})
    exprs = [to_sympy(leaf.meta["val"], gm) for leaf in leaves]
    constants = sorted(
        {
            c
            for n in order
            for c in (*n.args, *n.kwargs.values())
            if isinstance(c, int) and not isinstance(c, bool) and LENGTHS[-1] < c < 2**31
        }
    )
    lengths = [*LENGTHS, *(c + d for c in constants if c + 2 <= LONGEST for d in (1, 2))]
    seen: list[tuple[int, torch.Tensor]] = []
    for s in sorted(set(lengths)):
        feeds = [int(e.subs({B: 2, S: s})) for e in exprs]
        feeds += [buffers[n.meta[META_INPUT].name] for n in order if n.op == "placeholder"]
        try:
            got = run(*feeds)
        except Exception as exc:  # noqa: BLE001 - beyond the model's own longest sequence
            if s > LENGTHS[-1]:
                break  # the model cannot run this long either (MPT's ALiBi table, say)
            return f"its mask does not evaluate at sequence {s} ({type(exc).__name__})"
        if got.shape[-1] != s or (got.dim() >= 2 and got.shape[-2] not in (1, s)):
            return f"its mask is {tuple(got.shape)} at sequence {s}, not (…, {s}, {s})"
        if additive:
            if got.dtype == torch.bool:
                return "an additive mask of booleans"
            keep = got > MASKED
        else:
            keep = got if keep_is_true else ~got
        full = keep.expand(*keep.shape[:-2], s, s) if keep.dim() >= 2 else keep.expand(s, s)
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        if bool((full & (j > i)).any()):
            return f"it lets a query see later keys at sequence {s}"
        if not bool(full[..., torch.arange(s), torch.arange(s)].all()):
            return f"it hides a query's own key at sequence {s}"
        for t, before in seen:
            if not _consistent(before, got, t, additive, keep_is_true):
                return (
                    f"it is not a function of positions: at sequence {s} its first {t} rows "
                    f"and columns differ from the mask at sequence {t}"
                )
        seen.append((s, got))
    return None


def _consistent(small: torch.Tensor, big: torch.Tensor, t: int, additive: bool, keep: bool) -> bool:
    """``big``'s top-left t × t corner equals ``small`` (additive: kept entries up to one
    constant per row; masked ones masked in both)."""
    if big.dim() >= 2 and big.shape[-2] > 1:
        corner = big[..., :t, :t] if big.shape[-2] != small.shape[-2] else big[..., :t]
    else:
        corner = big[..., :t]
    small, corner = torch.broadcast_tensors(small, corner)
    if not additive:
        return bool((small == corner).all())
    kept = small > MASKED
    if not bool((kept == (corner > MASKED)).all()):
        return False
    diff = torch.where(kept, corner.double() - small.double(), torch.nan)
    hi = torch.nan_to_num(diff, nan=-torch.inf).amax(-1)
    lo = torch.nan_to_num(diff, nan=torch.inf).amin(-1)
    scale = torch.where(kept, small.double().abs(), 0.0).amax() + 1.0
    return bool(((hi - lo)[torch.isfinite(hi)] <= 1e-12 * scale).all())


def prove_scores(
    gm: fx.GraphModule,
    x: fx.Node,
    scores: fx.Node,
    sink: fx.Node | None = None,
    linear: bool = False,
) -> str | None:
    """None if ``x`` (a softmax's input), as a function of random ``scores`` [b, h, s, s] (and a
    random ``sink`` column), hides every later key, keeps each query's own, and is a function
    of positions: at a shorter length, on the first rows and columns of the same scores, it
    equals the longer length's up to one constant per row (the sink column included).
    ``linear``: ``x`` is multiplied by v directly (no softmax): a later key is hidden only by
    an exact 0, and the shorter length's values must equal the longer one's exactly (no row
    constant); a query's own key may be 0."""
    given = frozenset(n for n in (scores, sink) if n is not None)
    order, leaves, why = construction(x, given)
    if why:
        return why
    inputs = [scores, *([sink] if sink is not None else [])]
    run = _evaluator(gm, x, inputs, leaves, order)
    buffers = gm.meta.get(META_BUFFERS, {})
    size_exprs = [to_sympy(leaf.meta["val"], gm) for leaf in leaves]
    shapes = [[to_sympy(d, gm) for d in t.meta["val"].shape] for t in inputs]
    g = torch.Generator().manual_seed(0)
    big = None
    for s in (21, *LENGTHS[:-1]):  # the longest first: the shorter ones are its corners
        at = {B: 2, S: s}
        values = [
            3
            * torch.randn([int(e.subs(at)) for e in shape], generator=g, dtype=t.meta["val"].dtype)
            for shape, t in zip(shapes, inputs, strict=True)
        ]
        if big is not None:  # the same scores (and sinks): the first rows and columns
            values = [big[0][..., :s, :s], *([big[1][..., :s, :]] if sink is not None else [])]
        feeds = [*values, *(int(e.subs(at)) for e in size_exprs)]
        feeds += [buffers[n.meta[META_INPUT].name] for n in order if n.op == "placeholder"]
        try:
            got = run(*feeds)
        except Exception as exc:  # noqa: BLE001 - not evaluable is not proven
            return f"its scores do not evaluate at sequence {s} ({type(exc).__name__})"
        keys = got[..., :s]
        keep = keys != 0 if linear else keys > MASKED
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        if linear and bool((keep & (j > i)).any()):
            return f"it lets a query see later keys at sequence {s} (a later key's weight is not 0)"
        if bool((keep & (j > i)).any()):
            worst = float(keys[..., j > i].max())
            return (
                f"it lets a query see later keys at sequence {s} (a later key's score is "
                f"{worst:.3g}, above {MASKED:g}: its softmax weight is not exactly 0)"
            )
        if not linear and not bool(keep[..., torch.arange(s), torch.arange(s)].all()):
            return f"it hides a query's own key at sequence {s}"
        if big is None:
            big, whole = values, got
            continue
        corner = whole[..., :s, :s]
        if sink is not None:  # the sink column compares with the longer one's
            corner = torch.cat([corner, whole[..., :s, -1:]], -1)
        if not _consistent(got, corner, s + (sink is not None), not linear, keep=True):
            return (
                f"it is not a function of positions: at sequence {s} its scores differ from "
                f"the first {s} rows and columns of the same scores at sequence 21"
            )
    return None
