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

- keep every query's own key and hide every later key (additive: at most ``MASKED`` and at
  least ``MASKED / 2`` below the row's largest entry, or −inf; boolean: False where ``keep_is_true``): a chunk's queries
  never see a later chunk's keys;
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import sympy
import torch
from torch import fx

from autopart.errors import first_line
from autopart.frontend.capture import B, S, to_sympy
from autopart.layout import Plan
from autopart.meta import (
    META_BUFFERS,
    META_EXAMPLE_SHAPE,
    META_INPUT,
    META_LAYER,
    META_MASK_FN,
    META_MODULE,
)
from autopart.passes.seq_rules import SIZE_ARGS

aten = torch.ops.aten
# An additive entry at or below MASKED hides its key: the model's own softmax weight there,
# exp(entry - row max), is exactly 0 (it underflows) in float64 whenever the row's largest score
# is above MASKED + 746 (float32 and bfloat16: + 104), i.e. unless the query's own key scores
# below -9254. GPT-1's and BERT-era masks of -1e4 and the float minimum both qualify.
MASKED = -1e4


def said(exc: BaseException) -> str:
    """An exception's type and the first line of its message, for a refusal's reason."""
    first = first_line(exc)[:160] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def kept(entries: torch.Tensor) -> torch.Tensor:
    """The additive entries (or modified scores) that keep their key. A key is hidden by an
    entry at or below ``MASKED`` that is also at least ``MASKED / 2`` below the largest entry of
    its row: a softmax sees only differences within a row, and exp(−5000) is 0 in any float. An
    absolute threshold alone took ``where(tril, -9999, -10000)`` for a causal mask, though its
    later keys weigh e⁻¹ of the earlier ones (Seq1F1B trained it wrong: gradients 26 % off)."""
    top = entries.amax(-1, keepdim=True)
    return ~((entries <= MASKED) & ~(entries - top > MASKED / 2))


LENGTHS = (3, 5, 8, 13, 21)
# Every proof by evaluation also runs at the longest sequence the program will take: the capture
# example's length, and at least PROVEN tokens (a window or a threshold that no integer of the
# construction names shows only past its length); a program resting on one is refused a longer
# step (Plan.max_seq), since nothing was proven there.
PROVEN = 4096
_END = 9223372036854775807
T = TypeVar("T")


@dataclass
class Proofs:
    """What ``canonicalize_attention`` proves by evaluation: every proof holds up to ``longest``
    tokens, and ``memo`` keeps each result by the construction's ``signature`` (a model's layers
    share one, and so do the compiles of one capture: ``Captured.proofs``)."""

    longest: int
    memo: dict = field(default_factory=dict)

    def once(self, key: tuple | None, prove: Callable[[], T]) -> T:
        """``prove()``, or its result for an equal ``key`` (None: not kept)."""
        if key is None:
            return prove()
        key = (*key, self.longest)
        if key not in self.memo:
            self.memo[key] = prove()
        return cast("T", self.memo[key])


def signature(gm: fx.GraphModule, root: fx.Node, *given: fx.Node | None) -> tuple | None:
    """``root``'s construction up to node names (``_signature``), or None if it is not one."""
    inputs = [n for n in given if n is not None]
    order, leaves, why = construction(root, frozenset(inputs))
    return None if why else _signature(gm, root, inputs, order, leaves)


def proof_length(gm: fx.GraphModule, plan: Plan) -> int:
    """The sequence every proof also runs at: the capture example's, at least ``PROVEN``, at
    most the graph's own limit (``Plan.max_seq``: a table of positions, say)."""
    example = gm.meta.get(META_EXAMPLE_SHAPE, (0, 0))[1]
    longest = max(PROVEN, example)
    return longest if plan.max_seq is None else max(min(longest, plan.max_seq), LENGTHS[-1])


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
    why = _length_as_value(order, leaves, given)
    return order, [n for n in root.graph.nodes if n in leaves], why


# where a construction may read the sequence length: where any value may (``SIZE_ARGS``: a
# factory's, a view's, an expand's, a repeat's size; an arange's start or end, a slice's end),
# and also as a slice's start or an offset added to positions (a bias shifted by a per-row
# constant: MPT's ALiBi slices its table from the end, ``alibi[..., -s:]``;
# ``slope · (j − s + 1)``): op → argument indices
_LENGTH_ARGS: dict[Any, tuple[int, ...]] = {
    **SIZE_ARGS,
    aten.slice.Tensor: (2, 3),
    aten.add.Tensor: (0, 1),
    aten.sub.Tensor: (0, 1),
    aten.rsub.Scalar: (1,),
    aten.add.Scalar: (1,),
    aten.sub.Scalar: (1,),
}
_SYMBOLIC = frozenset(
    (
        operator.add,
        operator.sub,
        operator.mul,
        operator.floordiv,
        operator.neg,
        torch.sym_max,
        torch.sym_min,
    )
)
# ops whose value at a position reads positions after it, or the length: over a dim of the
# sequence's size they read the length as a value (cumulative ops read only earlier ones)
_WHOLE_DIM = frozenset(
    (
        aten.sum.default,
        aten.sum.dim_IntList,
        aten.mean.default,
        aten.mean.dim,
        aten.amax.default,
        aten.amin.default,
        aten.max.default,
        aten.min.default,
        aten.max.dim,
        aten.min.dim,
        aten.prod.default,
        aten.prod.dim_int,
        aten.any.default,
        aten.any.dim,
        aten.any.dims,
        aten.all.default,
        aten.all.dim,
        aten.argmax.default,
        aten.argmin.default,
        aten.count_nonzero.default,
        aten.count_nonzero.dim_IntList,
        aten.logsumexp.default,
        aten.std.correction,
        aten.var.correction,
        aten.sort.default,
        aten.topk.default,
        aten.flip.default,
        aten.roll.default,
    )
)


def _length_as_value(
    order: list[fx.Node], leaves: set[fx.Node], given: frozenset[fx.Node] = frozenset()
) -> str | None:
    """Why a construction reads the sequence length other than as a size (None: it does not).
    Evaluated at a few lengths, a mask computed from the length's value (``ones(s).sum() % 40
    == 32``, a window of ``where(s % 40 == 32, 8, 4)`` keys) can be causal and consistent at
    every length tried and not at the one a step runs at, where each Seq1F1B chunk then builds
    it at its own length (a probe's four such masks trained silently wrong: gradients 63 % to
    110 % off). So the length may be a size, a start or an end, or an offset (``_LENGTH_ARGS``),
    and nothing else; a reduction, a sort, a flip or a roll over a dim of the sequence's size,
    or a select from its end, reads it too, unless it acts on the ``given`` scores (a softmax's
    row maximum over the keys: a constant per row)."""
    if not order:
        return None
    gm = order[0].graph.owning_module
    assert gm is not None
    scored = set(given)
    for n in order:
        if any(a in scored for a in n.all_input_nodes):
            scored.add(n)
    symbolic = {
        n
        for n in (*leaves, *order)
        if isinstance(v := n.meta.get("val"), torch.SymInt) and S in to_sympy(v, gm).free_symbols
    }
    for n in order:
        uses: list[int | str] = [i for i, a in enumerate(n.args) if _mentions(a, symbolic)]
        uses += [k for k, a in n.kwargs.items() if _mentions(a, symbolic)]
        if uses and n.target not in _SYMBOLIC:
            allowed = _LENGTH_ARGS.get(n.target, ())
            if any(u not in allowed for u in uses):
                return f"its construction uses the sequence length as a value ({_op(n)})"
        if n in scored:
            continue
        if n.target in _WHOLE_DIM or (n.target == aten.select.int and _from_end(n)):
            x = n.args[0]
            val = x.meta.get("val") if isinstance(x, fx.Node) else None
            if isinstance(val, torch.Tensor) and _seq_dims(n, val, gm):
                return (
                    f"its construction reads the sequence length through {_op(n)} over a dim "
                    "of the sequence's size"
                )
    return None


def reads_length(root: fx.Node) -> str | None:
    """``_length_as_value`` of everything ``root`` is computed from (any inputs), for the
    provers that cut their own subgraph (``canonicalize_attention._evaluate_mask``)."""
    need: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in need or n in leaves:
            continue
        if n.target == aten.sym_size.int:
            leaves.add(n)
        elif n.op == "call_function":
            need.add(n)
            stack.extend(n.all_input_nodes)
    return _length_as_value([n for n in root.graph.nodes if n in need], leaves)


def _mentions(a: Any, nodes: set[fx.Node]) -> bool:
    if isinstance(a, fx.Node):
        return a in nodes
    if isinstance(a, (list, tuple)):
        return any(_mentions(x, nodes) for x in a)
    return False


def _op(n: fx.Node) -> str:
    return f"{n.name}: {getattr(n.target, '__name__', n.target)}"


def _from_end(n: fx.Node) -> bool:
    """A select at a negative index (counted from the end of its dim)."""
    index = n.args[2] if len(n.args) > 2 else None
    return not isinstance(index, int) or index < 0


# where an op of ``_WHOLE_DIM`` (or a select) names its dims: (argument index, keyword,
# default); every other op's is argument 1, "dim", None (None: every dim)
_DIMS_AT: dict[Any, tuple[int, str, Any]] = {
    aten.sort.default: (1, "dim", -1),
    aten.topk.default: (2, "dim", -1),
    aten.roll.default: (2, "dims", ()),
}


def _seq_dims(n: fx.Node, val: torch.Tensor, gm: fx.GraphModule) -> bool:
    """Does ``n`` act over a dim of ``val`` whose size depends on the sequence length (every
    dim when it names none)?"""
    at, key, default = _DIMS_AT.get(n.target, (1, "dim", None))
    dims: Any = n.args[at] if len(n.args) > at else n.kwargs.get(key, default)
    named = dims if isinstance(dims, (list, tuple)) else [] if dims is None else [dims]
    if not all(isinstance(d, int) for d in named):
        return True  # a dim not known at compile time: taken as the sequence's
    picked = [int(d) % max(val.dim(), 1) for d in named] or list(range(val.dim()))
    return any(S in to_sympy(val.shape[d], gm).free_symbols for d in picked)


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
    gm: fx.GraphModule,
    mask: fx.Node,
    additive: bool,
    keep_is_true: bool = True,
    *,
    longest: int,
) -> str | None:
    """None if the rebuilt ``mask`` is a causal position function (module docstring) at every
    length tried up to ``longest``, else why not. Boolean masks keep where True when
    ``keep_is_true``; additive ones are added to the scores."""
    order, leaves, why = construction(mask)
    if why:
        return why
    run = _evaluator(gm, mask, [], leaves, order)
    buffers = gm.meta.get(META_BUFFERS, {})
    exprs = [to_sympy(leaf.meta["val"], gm) for leaf in leaves]
    seen: list[tuple[int, torch.Tensor]] = []
    for s in proof_lengths(order, longest):
        feeds = [int(e.subs({B: 2 if s <= LENGTHS[-1] else 1, S: s})) for e in exprs]
        feeds += [buffers[n.meta[META_INPUT].name] for n in order if n.op == "placeholder"]
        if any(isinstance(f, torch.Tensor) and f.is_meta for f in feeds):
            return (  # a buffer of a model built on the meta device: it has no values
                "its mask is built from a buffer of a model on the meta device, which has no "
                "values to prove it by (build the model on a real device)"
            )
        try:
            got = run(*feeds)
        except Exception as exc:  # noqa: BLE001 - not evaluable is not proven
            return f"its mask does not evaluate at sequence {s} ({said(exc)})"
        if got.shape[-1] != s or (got.dim() >= 2 and got.shape[-2] not in (1, s)):
            return f"its mask is {tuple(got.shape)} at sequence {s}, not (…, {s}, {s})"
        if additive:
            if got.dtype == torch.bool:
                return "an additive mask of booleans"
            keep = kept(got)
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


def proof_lengths(
    order: list[fx.Node], longest: int, shortest: tuple[int, ...] = LENGTHS
) -> list[int]:
    """The lengths a construction is evaluated at: ``shortest``, just past every integer it
    names beyond them (a window or a block shows only there), and ``longest`` (one no integer
    names)."""
    named = {
        c + d
        for n in order
        for c in (*n.args, *n.kwargs.values())
        if isinstance(c, int) and not isinstance(c, bool) and shortest[-1] < c < longest
        for d in (1, 2)
    }
    return sorted({*shortest, *(c for c in named if c <= longest), longest})


def _consistent(
    small: torch.Tensor, big: torch.Tensor, t: int, additive: bool, keep: bool, rel: float = 1e-12
) -> bool:
    """``big``'s top-left t × t corner equals ``small`` (additive: kept entries up to one
    constant per row, to ``rel`` of the largest entry; masked ones masked in both)."""
    if big.dim() >= 2 and big.shape[-2] > 1:
        corner = big[..., :t, :t] if big.shape[-2] != small.shape[-2] else big[..., :t]
    else:
        corner = big[..., :t]
    small, corner = torch.broadcast_tensors(small, corner)
    if not additive:
        return bool((small == corner).all())
    live = kept(small)
    if not bool((live == kept(corner)).all()):
        return False
    small = small.double()
    diff = corner.double() - small
    hi = torch.where(live, diff, -torch.inf).amax(-1)
    lo = torch.where(live, diff, torch.inf).amin(-1)
    scale = torch.where(live, small.abs(), 0.0).amax() + 1.0
    return bool(((hi - lo)[torch.isfinite(hi)] <= rel * scale).all())


def _score_runner(
    gm: fx.GraphModule, x: fx.Node, scores: fx.Node, sink: fx.Node | None
) -> tuple[Any, list[list[sympy.Expr]]] | str:
    """A function evaluating ``x`` at a sequence length from given ``scores`` (and ``sink``
    column) values, and the symbolic shapes of those inputs; or why ``x`` is not evaluable."""
    given = frozenset(n for n in (scores, sink) if n is not None)
    order, leaves, why = construction(x, given)
    if why:
        return why
    inputs = [scores, *([sink] if sink is not None else [])]
    run = _evaluator(gm, x, inputs, leaves, order)
    buffers = gm.meta.get(META_BUFFERS, {})
    size_exprs = [to_sympy(leaf.meta["val"], gm) for leaf in leaves]
    held = [buffers[n.meta[META_INPUT].name] for n in order if n.op == "placeholder"]

    def at(s: int, values: list[torch.Tensor], b: int = 2) -> torch.Tensor:
        return run(*values, *(int(e.subs({B: b, S: s})) for e in size_exprs), *held)

    return at, [[to_sympy(d, gm) for d in t.meta["val"].shape] for t in inputs]


def prove_scores(
    gm: fx.GraphModule,
    x: fx.Node,
    scores: fx.Node,
    longest: int,
    sink: fx.Node | None = None,
    linear: bool = False,
) -> str | None:
    """None if ``x`` (a softmax's input), as a function of random ``scores`` [b, h, s, s] (and a
    random ``sink`` column), hides every later key, keeps each query's own, and is a function
    of positions: at a shorter length, on the first rows and columns of the same scores, it
    equals the longer length's up to one constant per row (the sink column included). Tried at
    ``longest`` tokens (one batch row, and the scores shared by the heads where f broadcasts
    them), then on its first 21, 13, 8, 5 and 3 rows and columns.
    ``linear``: ``x`` is multiplied by v directly (no softmax): a later key is hidden only by
    an exact 0, and the shorter length's values must equal the longer one's exactly (no row
    constant); a query's own key may be 0."""
    runner = _score_runner(gm, x, scores, sink)
    if isinstance(runner, str):
        return runner
    run, shapes = runner
    dtypes = [t.meta["val"].dtype for t in (scores, sink) if t is not None]
    g = torch.Generator().manual_seed(0)
    big: list[torch.Tensor] | None = None
    whole = torch.empty(0)
    longest = max(longest, LENGTHS[-1])
    for s in (longest, *sorted(set(LENGTHS) - {longest}, reverse=True)):
        if big is None:  # the longest: the shorter ones are its corners
            made = _scores_at(run, shapes, dtypes, s, g)
            if isinstance(made, str):
                return made
            big, whole = made
            got = whole
        else:  # the same scores (and sinks): the first rows and columns
            values = [big[0][..., :s, :s], *([big[1][..., :s, :]] if sink is not None else [])]
            try:
                got = run(s, [v.contiguous() for v in values], b=1)
            except Exception as exc:  # noqa: BLE001 - not evaluable is not proven
                return f"its scores do not evaluate at sequence {s} ({type(exc).__name__})"
        keys = got[..., :s]
        keep = keys != 0 if linear else kept(keys)
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        if linear and bool((keep & (j > i)).any()):
            return f"it lets a query see later keys at sequence {s} (a later key's weight is not 0)"
        if bool((keep & (j > i)).any()):
            worst = float(keys[..., j > i].max())
            return (
                f"it lets a query see later keys at sequence {s} (a later key's score is "
                f"{worst:.3g}: above {MASKED:g}, or within {-MASKED / 2:g} of its row's largest, "
                "so its softmax weight is not exactly 0)"
            )
        if not linear and not bool(keep[..., torch.arange(s), torch.arange(s)].all()):
            return f"it hides a query's own key at sequence {s}"
        if got is whole:
            continue
        corner = whole[..., :s, :s]
        if sink is not None:  # the sink column compares with the longer one's
            corner = torch.cat([corner, whole[..., :s, -1:]], -1)
        if not _consistent(got, corner, s + (sink is not None), not linear, keep=True):
            return (
                f"it is not a function of positions: at sequence {s} its scores differ from "
                f"the first {s} rows and columns of the same scores at sequence {whole.shape[-2]}"
            )
    return None


def _scores_at(
    run: Any, shapes: list[list[sympy.Expr]], dtypes: list[torch.dtype], s: int, g: torch.Generator
) -> tuple[list[torch.Tensor], torch.Tensor] | str:
    """Random scores (and sinks) at ``s`` tokens, one batch row, and f of them: shared by every
    other dim where f broadcasts them (the heads), else of their own shapes; or why f does not
    evaluate."""
    why = ""
    for shared in (True, False):
        values = [
            3
            * torch.randn(
                [int(e.subs({B: 1, S: s})) if shared is False or e.has(S) else 1 for e in shape],
                generator=g,
                dtype=d,
            )
            for shape, d in zip(shapes, dtypes, strict=True)
        ]
        try:
            return values, run(s, values, b=1)
        except Exception as exc:  # noqa: BLE001 - not evaluable is not proven
            why = f"its scores do not evaluate at sequence {s} ({type(exc).__name__})"
    return why


def score_window(
    gm: fx.GraphModule,
    x: fx.Node,
    scores: fx.Node,
    longest: int,
    sink: fx.Node | None = None,
    linear: bool = False,
) -> int | str | None:
    """The sliding window W of a score function ``prove_scores`` proved — query i sees no key
    j ≤ i − W — if shifting positions changes nothing, so that a chunk's queries given only the
    last W − 1 earlier keys (positions counted from the first of them) compute the same; else
    None, and the chunk pass keeps the whole prefix (exact for any window).

    f is evaluated (one batch row, the random scores shared by the heads, as f broadcasts) at
    21 tokens, just past every length its construction names (Gemma 2's window of 4096 shows
    only at 4097 tokens) and at ``longest``, as ``prove``. W is one more than the
    farthest key any query keeps, and must leave a key hidden at the longest length tried.
    Then, at that length, the rows and columns from t on must equal f at t fewer tokens on the
    same scores (up to one constant per row, to the rounding of the dtype; ``linear``:
    exactly), for t = 1 and W: where the positions start does not matter
    (Llama 4's blocks also hide every key W behind, but fail this). A later key kept at one of
    the longer lengths (which ``prove_scores`` does not evaluate) gives why, a string: the
    attention is then not causal."""
    order, _, why = construction(x, frozenset(n for n in (scores, sink) if n is not None))
    runner = None if why else _score_runner(gm, x, scores, sink)
    if runner is None or isinstance(runner, str):
        return None
    run, _ = runner
    gen, window = torch.Generator().manual_seed(1), 0
    dtypes = [t.meta["val"].dtype for t in (scores, sink) if t is not None]
    for s in proof_lengths(order, max(longest, LENGTHS[-1]), (LENGTHS[-1],)):
        widths = [s, *([1] if sink is not None else [])]
        values = [
            3 * torch.randn(1, 1, s, w, generator=gen, dtype=d)
            for w, d in zip(widths, dtypes, strict=True)
        ]
        try:
            whole = run(s, values, b=1)
        except Exception:  # noqa: BLE001 - not evaluable so: no window
            return None
        keep = whole[..., :s] != 0 if linear else kept(whole[..., :s])
        rows = keep.reshape(-1, s, s).any(0)  # [s, s]: kept by some batch row or head
        if bool(rows.triu(1).any()):  # at a length prove_scores did not try
            return f"it lets a query see later keys at sequence {s}"
        first = rows.to(torch.uint8).argmax(-1)  # each query's first kept key (its own: kept)
        window = max(window, int((torch.arange(s) - first).amax()) + 1)
    if window > s - 2:
        return None  # every key kept at the longest length tried: no window seen
    for t in sorted({1, window}):
        shifted = [values[0][..., t:, t:], *([values[1][..., t:, :]] if sink is not None else [])]
        try:
            got = run(s - t, [v.contiguous() for v in shifted], b=1)
        except Exception:  # noqa: BLE001 - not evaluable shifted: not proven
            return None
        corner = whole[..., t:, t:s]
        if sink is not None:
            corner = torch.cat([corner, whole[..., t:, -1:]], -1)
        # a row's own constant (gpt-oss subtracts its row max) differs in the last bits when
        # the row holds fewer keys: the rounding of the model's dtype is allowed
        rel = 16 * torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
        if got.shape != corner.shape or not _consistent(
            got, corner, s - t + (sink is not None), not linear, keep=True, rel=rel
        ):
            return None
    return window


def _signature(
    gm: fx.GraphModule, x: fx.Node, given: list[fx.Node], order: list[fx.Node], leaves: list
) -> tuple:
    """The construction of ``x`` up to node names: each node's op, target and arguments, the
    ``given`` inputs by position, dtype and shape, sizes by their expressions, buffers by name
    (the layers of a model, rebuilt one by one, give equal signatures)."""
    index = {n: i for i, n in enumerate(order)}
    named: dict[fx.Node, Any] = {
        n: ("in", i, str(n.meta["val"].dtype)) for i, n in enumerate(given)
    }
    named |= {n: ("size", str(to_sympy(n.meta["val"], gm))) for n in leaves}

    def ref(a: fx.Node) -> Any:
        if a in named:
            return named[a]
        if a.op == "placeholder":
            return ("buffer", a.meta[META_INPUT].name)
        return ("node", index[a])

    shapes = tuple(str([to_sympy(d, gm) for d in n.meta["val"].shape]) for n in given)
    body = tuple((n.op, str(n.target), str(fx.map_arg((n.args, n.kwargs), ref))) for n in order)
    return (shapes, body, ref(x))
