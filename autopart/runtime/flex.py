"""FlexAttention lowering (``Plan.attention == "flex"``): a rank's stage graph with its masked
and general-form attention replaced by ``torch.nn.attention.flex_attention`` calls.

Programs stay ATen (a saved program names no Python function); each rank lowers its own stage
graphs when it builds them (``Runner._runs``), so the same program runs either way. The
lowering is exact by construction and needs no proof from the compiler: it rewrites only what
it recognizes below and leaves anything else as it is. Two shapes of attention are lowered:

1. ``aten.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=…)``, 4-D, with a mask:
   a boolean mask becomes the ``mask_mod`` (the mask read at each (b, h, q, kv)); an additive
   one a ``score_mod`` adding it, and a ``mask_mod`` hiding where it is −inf. SDPA's plain
   ``is_causal`` form is left alone (its kernels already skip the upper triangle);
2. the general form the chunk pass also handles (``passes/canonicalize_attention.py``, form 6):
   ``softmax(f(q·kᵀ))`` [→ casts] [→ the sink column cut off] → ``matmul(·, v)``, with f a chain
   of elementwise ops in the scores from ``_STEPS``: scalar arithmetic, ``tanh`` (soft-capping),
   and terms added, multiplied, filled or clamped. f becomes the ``score_mod`` (the chain replayed
   on each score, every term read at its (b, h, q, kv)); the ``mask_mod`` hides the entries f
   makes −inf whatever the score (``_hidden``: a fill or term of −inf, kept through the steps
   that keep −inf). A sink column s (gpt-oss: ``softmax(cat([f(scores), s]))[..., :-1]``)
   scales FlexAttention's output by ``sigmoid(lse − s)``, exp(lse) / (exp(lse) + exp(s)); a row
   max subtracted before the softmax is dropped (softmax is unchanged by it).

A term must be a constant of the step (no parameter, activation or K/V prefix among what it is
computed from): FlexAttention's ``score_mod`` reads it, and gives it no gradient. A mask whose
row hides every key gives 0 under FlexAttention where SDPA's math kernel gives NaN.

FlexAttention builds its Triton kernels under ``torch.compile`` (``compile=True``); without it,
torch runs a dense reference that materializes the scores. Its CPU backward is refused by torch
2.13, so ``check_supported`` refuses ``attention="flex"`` on a CPU rank before any step (the tests
lift that guard to run torch's dense backward on CPU in float64). See docs/runtime.md for what
ran where.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import fx

from autopart.errors import AutopartError, first_line
from autopart.graph import cuts_last_column, only_user, reaches, row_max_of
from autopart.meta import META_INPUT, META_LAYER, META_MODULE, META_RECOMPUTE

aten = torch.ops.aten

_SDPA = aten.scaled_dot_product_attention.default
_SOFTMAX = (aten._softmax.default, aten.softmax.int)
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
_CHECKS = (aten._assert_tensor_metadata.default,)  # export's checks: they compute nothing
# elementwise steps of f, replayed on each score (the chain's value is one of the arguments)
_STEPS = (
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.tanh.default,
    aten.neg.default,
    aten.masked_fill.Scalar,
    aten.where.ScalarOther,
    aten.maximum.default,
    aten.max.other,
    aten.clamp.default,
)
# what a term may be computed from: constants of the step (no gradient flows into a score_mod's
# captured tensors)
_CONSTANT_INPUTS = frozenset({"buffer", "constant", "data", "offset", "keys", "rank"})


# a step's arguments name the chain's value and the terms with these strings (the graph's code
# prints the steps as literals; no ATen op of ``_STEPS`` takes a string positionally)
PREV = "@scores"


def term(i: int) -> str:
    """How a step's arguments name the i-th term tensor."""
    return f"@term{i}"


def _term_index(a: Any) -> int | None:
    return int(a[5:]) if isinstance(a, str) and a.startswith("@term") else None


Step = tuple[Any, tuple[Any, ...]]  # (ATen op, its arguments with PREV and term(i))


@dataclass
class Lowered:
    """What ``lower_attention`` did to one graph: the attention nodes it replaced, and why it
    left each other softmax or masked SDPA alone."""

    lowered: list[str]
    kept: list[str]


def summary(reports: dict[int, Lowered]) -> str:
    """One line for a rank's stages: how many attention nodes each lowered, and the first one
    left as captured, with why."""
    done = ", ".join(f"stage {k}: {len(r.lowered)}" for k, r in sorted(reports.items()))
    kept = [line for r in reports.values() for line in r.kept]
    line = f"attention=flex: lowered to FlexAttention ({done})"
    if kept:
        line += f"; left as captured: {kept[0]}" + (f" (+{len(kept) - 1} more)" if kept[1:] else "")
    return line


def lower_attention(gm: fx.GraphModule, min_head_dim: int = 1) -> Lowered:
    """Replace, in place, every attention of the module docstring's two shapes with a call of
    ``flex_sdpa`` or ``flex_general``; the nodes it leaves are listed with why. An attention
    whose q, k or v head dim is below ``min_head_dim`` stays (FlexAttention's Triton kernels
    need 16: the runner asks for that when it compiles for CUDA)."""
    report = Lowered([], [])
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n._erased:  # erased: part of an attention lowered above
            continue
        if n.target == _SDPA:
            why = _lower_sdpa(gm, n, min_head_dim)
        elif n.target in _SOFTMAX:
            why = _lower_general(gm, n, min_head_dim)
        else:
            continue
        if why is None:
            report.lowered.append(n.name)
        elif why:
            report.kept.append(f"{n.name} ({n.meta.get(META_MODULE, '')}): {why}")
    if report.lowered:
        gm.graph.lint()
        gm.recompile()
    return report


# -- SDPA with a mask ---------------------------------------------------------------------


def _lower_sdpa(gm: fx.GraphModule, n: fx.Node, min_head_dim: int) -> str | None:
    args = list(n.args) + [None] * (6 - len(n.args))
    q, k, v, mask, dropout, causal = args[:6]
    if mask is None:
        return ""  # plain causal or full: SDPA's own kernels
    if not isinstance(mask, fx.Node) or dropout not in (None, 0, 0.0) or causal:
        return "a mask with dropout or is_causal"
    if n.kwargs.get("dropout_p", 0.0) or n.kwargs.get("is_causal", False):
        return "a mask with dropout or is_causal"
    if not all(_dims(x) == 4 for x in (q, k, v)) or not 0 <= _dims(mask) <= 4:
        return "not 4-D [b, h, s, d]"
    if _narrow(min_head_dim, q, k, v):
        return f"a head dim below {min_head_dim}, the least FlexAttention's kernels take"
    if _dtype(mask) != torch.bool and not _constant(mask):
        return "an additive mask computed from parameters or activations (it needs a gradient)"
    groups = _groups(q, k, v)
    if groups is None:
        return "k and v do not share q's batch, or their heads do not divide q's"
    with gm.graph.inserting_before(n):
        new = gm.graph.call_function(
            flex_sdpa, (q, k, v, mask), {"scale": n.kwargs.get("scale"), "enable_gqa": groups}
        )
    _replace(n, new)
    return None


def flex_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, mask, scale=scale)`` through FlexAttention."""
    m = _four(mask)
    if m.dtype == torch.bool:
        score_mod = None
        keep = m
    else:
        score_mod = _reader_mod(lambda score, at: score + at(0).to(score.dtype), [m])
        keep = m != float("-inf")
    block = _block_mask(keep, q, k)
    out = _flex(q, k, v, score_mod, block, scale, enable_gqa, lse=False)[0]
    return out


# -- the general form ---------------------------------------------------------------------


def _lower_general(gm: fx.GraphModule, sm: fx.Node, min_head_dim: int) -> str | None:
    x = sm.args[0]
    if not isinstance(x, fx.Node) or _dims(x) != 4 or _last_dim(sm) is False:
        return ""  # not a softmax over keys of 4-D scores
    # forward: casts, the sink column's slice, casts, then the product with v
    user, sink_cut = _past_casts(only_user(sm)), None
    if user is not None and cuts_last_column(user):
        sink_cut, user = user, _past_casts(only_user(user))
    if user is None or user.target != aten.matmul.default or _dims(user) != 4:
        return f"its probabilities reach {_name(user)} before a product with v"
    pv, v = user, user.args[1]
    # backward: the row max subtracted, the sink column, then f down to q·kᵀ
    n: Any = x
    sink: Any = None
    if n.target == aten.sub.Tensor and row_max_of(n.args[1], n.args[0]):
        n = n.args[0]
    if n.target == aten.cat.default:
        parts: Any = n.args[0]
        dim = n.args[1] if len(n.args) > 1 else 0
        if sink_cut is None or dim not in (-1, 3) or len(parts) != 2:
            return "a join along the keys that is not a sink column"
        n, sink = parts
        if _last(sink) != 1 or _reaches(sink):
            return "a sink column that is not one value per row"
    elif sink_cut is not None:
        return "a column cut off that no sink joined"
    top = n  # f's value: the scores softmax takes, the sink column aside
    steps: list[Step] = []
    terms: list[fx.Node] = []
    product = None
    for _ in range(48):
        if _is_product(n):
            product = n
            break
        if n.target in _CASTS:  # FlexAttention computes scores in float32 at least
            n = n.args[0]
            continue
        if n.target not in _STEPS:
            return f"{n.name} ({n.target}) is not an elementwise step of f"
        prev = [a for a in n.args if isinstance(a, fx.Node) and _reaches(a)]
        if len(prev) != 1:
            return f"{n.name} reads the scores more than once"
        step_args: list[Any] = []
        for a in n.args:
            if a is prev[0]:
                step_args.append(PREV)
            elif isinstance(a, fx.Node):
                if not _constant(a) or _dims(a) > 4:
                    return f"{n.name} reads a term that is not a constant of the step"
                terms.append(a)
                step_args.append(term(len(terms) - 1))
            elif isinstance(a, (int, float, bool)) or a is None:
                step_args.append(a)
            else:
                return f"{n.name} has an argument it cannot replay"
        if n.kwargs:
            return f"{n.name} has keyword arguments"
        steps.append((n.target, tuple(step_args)))
        n = prev[0]
    if product is None:
        return "no q·kᵀ under its scores"
    q, kt = cast("tuple[fx.Node, fx.Node]", product.args)
    if _dims(q) != 4 or _dims(v) != 4 or _groups(q, kt, v) is not False:
        return "q, k and v differ in batch or heads"
    if _dtype(q) != _dtype(v) or _dtype(q) != _dtype(kt):
        return "q, k and v differ in dtype"
    if _narrow(min_head_dim, q, v):
        return f"a head dim below {min_head_dim}, the least FlexAttention's kernels take"
    if not all(_broadcasts(t, product) for t in [*terms, top]):
        return "a term that does not broadcast to the scores' shape"
    steps.reverse()
    with gm.graph.inserting_before(pv):
        k = gm.graph.call_function(aten.transpose.int, (kt, -2, -1))
        new = gm.graph.call_function(flex_general, (q, k, v, sink, *terms), {"steps": tuple(steps)})
    _replace(pv, new, dtype=_dtype(pv))
    return None


def flex_general(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    *terms: torch.Tensor,
    steps: tuple[Step, ...],
) -> torch.Tensor:
    """``softmax(f(q·kᵀ) [, sink]) · v`` through FlexAttention, f the ``steps`` replayed."""
    four = [_four(t) for t in terms]

    def replay(score: torch.Tensor, at: Callable[[int], torch.Tensor]) -> torch.Tensor:
        y = score
        for target, args in steps:
            y = target(*(y if a == PREV else _arg(a, at) for a in args))
        return y.to(score.dtype)

    score_mod = _reader_mod(replay, four) if steps else None
    block = _block_mask(~_hidden(steps, four), q, k)
    out, lse = _flex(q, k, v, score_mod, block, 1.0, False, lse=sink is not None)
    if sink is not None:
        s = sink.expand(*q.shape[:3], 1)[..., 0].to(lse.dtype)
        out = out * torch.sigmoid(lse - s).unsqueeze(-1).to(out.dtype)
    return out


def _arg(a: Any, at: Callable[[int], torch.Tensor]) -> Any:
    i = _term_index(a)
    return a if i is None else at(i)


def _hidden(steps: Sequence[Step], terms: list[torch.Tensor]) -> torch.Tensor:
    """Where f is −inf whatever the (finite) score: a boolean of the terms' broadcast shape."""
    inf = float("inf")
    h: torch.Tensor = torch.zeros((), dtype=torch.bool)
    for target, args in steps:
        t = next((terms[i] for i in map(_term_index, args) if i is not None), None)
        scalar = next((a for a in args if isinstance(a, (int, float)) and a is not True), None)
        first = args[0] == PREV
        if target in (aten.tanh.default, aten.neg.default):
            h = torch.zeros((), dtype=torch.bool)
        elif target in (aten.add.Tensor, aten.sub.Tensor) and t is not None:
            sign = 1 if target == aten.add.Tensor else -1
            if target == aten.sub.Tensor and not first:
                h = torch.zeros((), dtype=torch.bool)
            else:
                h = (h | (t * sign == -inf)) & (t * sign != inf)
        elif target in (aten.add.Tensor, aten.sub.Tensor):
            keep = (
                scalar is not None and abs(scalar) != inf and (first or target == aten.add.Tensor)
            )
            h = h if keep else torch.zeros((), dtype=torch.bool)
        elif target == aten.mul.Tensor and t is not None:
            h = h & (t > 0) & (t != inf)
        elif target in (aten.mul.Tensor, aten.div.Tensor):  # by a scalar (a term: div)
            ok = t is None and scalar is not None and 0 < scalar < inf
            h = (
                h
                if ok and (first or target == aten.mul.Tensor)
                else torch.zeros((), dtype=torch.bool)
            )
        elif target == aten.masked_fill.Scalar and t is not None:
            h = torch.where(t, args[2] == -inf, h)
        elif target == aten.where.ScalarOther and t is not None and args[1] == PREV:
            h = torch.where(t, h, args[2] == -inf)
        elif target in (aten.maximum.default, aten.max.other) and t is not None:
            h = h & (t == -inf)
        else:  # clamp and anything else: no −inf is certain afterwards
            h = torch.zeros((), dtype=torch.bool)
    return _four(h)


# -- FlexAttention ------------------------------------------------------------------------


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Any,
    block: Any,
    scale: float | None,
    enable_gqa: bool,
    *,
    lse: bool,
) -> tuple[torch.Tensor, Any]:
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    out, aux = flex_attention(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block,
        scale=scale,
        enable_gqa=enable_gqa,
        return_aux=AuxRequest(lse=lse),
    )
    return out, aux.lse


def _block_mask(keep: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Any:
    """FlexAttention's block mask of ``keep`` ([B|1, H|1, Lq|1, Lk|1], True: the key is seen);
    None when it hides nothing."""
    from torch.nn.attention.flex_attention import create_block_mask

    if keep.numel() == 1 and bool(keep.reshape(())):  # nothing hidden (a shape known statically)
        return None
    keep = keep.to(q.device)
    mask_mod = _reader_mask(keep)
    b = keep.shape[0] if keep.shape[0] > 1 else None
    h = keep.shape[1] if keep.shape[1] > 1 else None
    return create_block_mask(mask_mod, b, h, q.shape[-2], k.shape[-2], device=q.device)


def _reader_mod(
    fn: Callable[[torch.Tensor, Callable[[int], torch.Tensor]], torch.Tensor],
    tensors: list[torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """A ``score_mod`` calling ``fn(score, at)``, ``at(i)`` the i-th tensor at (b, h, q, kv)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return fn(score, lambda i: _at(tensors[i], b, h, q_idx, kv_idx))

    return score_mod


def _reader_mask(keep: torch.Tensor) -> Callable[..., torch.Tensor]:
    def mask_mod(b, h, q_idx, kv_idx):
        return _at(keep, b, h, q_idx, kv_idx)

    return mask_mod


def _at(t: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
    """``t`` ([B|1, H|1, Lq|1, Lk|1]) read at (b, h, q, kv): index 0 along a broadcast dim."""
    index = tuple(
        i if size > 1 else 0 for i, size in zip((b, h, q_idx, kv_idx), t.shape, strict=True)
    )
    return t[index]


def _four(t: torch.Tensor) -> torch.Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


def check_supported(device: torch.device, rank: int) -> None:
    """Refuse ``attention="flex"`` where this torch cannot run FlexAttention's backward: one
    tiny call with gradients on ``device``, before any step."""
    from torch.nn.attention.flex_attention import flex_attention

    x = torch.zeros(1, 1, 16, 16, device=device, requires_grad=True)
    try:
        flex_attention(x, x, x).sum().backward()
    except (NotImplementedError, RuntimeError, ValueError) as exc:
        first = first_line(exc)
        raise AutopartError(
            f"rank {rank}: attention='flex' cannot run on {device}: {first}",
            hint="FlexAttention trains on CUDA; on this device use attention='sdpa' (the default)",
        ) from None


# -- graph helpers ------------------------------------------------------------------------


def _replace(old: fx.Node, new: fx.Node, dtype: torch.dtype | None = None) -> None:
    if dtype is not None and dtype != _dtype(new.args[0]):
        with old.graph.inserting_after(new):
            cast = old.graph.call_function(aten._to_copy.default, (new,), {"dtype": dtype})
        new = cast
    for key in (META_MODULE, "val", "stack_trace", META_LAYER, META_RECOMPUTE):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    old.replace_all_uses_with(new)
    _erase(old.graph, old)


def _name(n: fx.Node | None) -> str:
    return "nothing" if n is None else f"{n.name} ({n.target})"


def _narrow(least: int, *xs: Any) -> bool:
    """Whether any of ``xs`` has a last dim (the head dim) below ``least``."""
    return (
        any(not isinstance(_last(x), int) or _last(x) < least for x in xs) if least > 1 else False
    )


def _val(n: Any) -> torch.Tensor | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _dims(n: Any) -> int:
    val = _val(n)
    return -1 if val is None else val.dim()


def _dtype(n: Any) -> torch.dtype | None:
    val = _val(n)
    return None if val is None else val.dtype


def _last(n: Any) -> Any:
    val = _val(n)
    return None if val is None or val.dim() == 0 else val.shape[-1]


def _last_dim(sm: fx.Node) -> bool:
    dim = sm.args[1] if len(sm.args) > 1 else None
    return isinstance(dim, int) and dim in (-1, 3)


def _past_casts(n: fx.Node | None) -> fx.Node | None:
    """The first of ``n`` and its only users that is not a cast, a clone or a dropout of
    p = 0 (each leaves the values as they are, up to the dtype)."""
    while n is not None and (
        n.target in _CASTS
        or n.target == aten.clone.default
        or (n.target == aten.dropout.default and n.args[1] in (0, 0.0))
    ):
        n = only_user(n)
    return n


def _erase(g: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` if nothing but metadata checks uses it, then its inputs the same way."""
    stack, gone = [node], set()
    while stack:
        n = stack.pop()
        if n in gone or n.op != "call_function":
            continue
        if any(u.target not in _CHECKS for u in n.users):
            continue
        for u in list(n.users):
            g.erase_node(u)
            gone.add(u)
        stack.extend(n.all_input_nodes)
        g.erase_node(n)
        gone.add(n)


def _is_product(n: fx.Node) -> bool:
    """``matmul(q, transpose(k, -2, -1))`` of 4-D tensors."""
    if n.target != aten.matmul.default or _dims(n) != 4 or len(n.args) != 2:
        return False
    kt = n.args[1]
    if not isinstance(kt, fx.Node) or kt.target != aten.transpose.int or _dims(kt) != 4:
        return False
    dims: Any = kt.args[1:3]
    return all(isinstance(d, int) for d in dims) and sorted(d % 4 for d in dims) == [2, 3]


def _reaches(a: fx.Node) -> bool:
    """Whether ``a`` is computed from a q·kᵀ product."""
    return reaches(a, _is_product, 64)


def _constant(n: fx.Node) -> bool:
    """Computed only from constants of the step (``_CONSTANT_INPUTS``) and sizes (a size of an
    activation is a constant: no gradient flows through it)."""
    stack, seen = [n], set()
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if (
            m is not n
            and m.op == "call_function"
            and not isinstance(m.meta.get("val"), torch.Tensor)
        ):
            continue  # a size (SymInt or int)
        if m.op == "placeholder":
            ref = m.meta.get(META_INPUT)
            if ref is None or ref.kind not in _CONSTANT_INPUTS:
                return False
        elif m.op == "get_attr":
            continue
        elif m.op != "call_function":
            return False
        stack.extend(m.all_input_nodes)
    return True


def _groups(q: Any, k: Any, v: Any) -> bool | None:
    """Whether FlexAttention needs ``enable_gqa`` (k and v have fewer heads than q,
    as grouped-query attention, or one head SDPA broadcasts, as multi-query attention does);
    None when their batch or heads fit neither."""
    qs, ks, vs = (_val(x) for x in (q, k, v))
    if qs is None or ks is None or vs is None or str(qs.shape[0]) != str(ks.shape[0]):
        return None
    if str(ks.shape[:2]) != str(vs.shape[:2]) or str(qs.shape[0]) != str(vs.shape[0]):
        return None
    hq, hk = qs.shape[1], ks.shape[1]
    if not isinstance(hq, int) or not isinstance(hk, int) or hq % hk:
        return None
    return hq != hk


def _broadcasts(t: fx.Node, scores: fx.Node) -> bool:
    """``t`` has the scores' size or 1 in every dim (counted from the right): reading it at
    (b, h, q, kv) is what broadcasting it against the scores reads."""
    tv, sv = _val(t), _val(scores)
    if tv is None or sv is None or tv.dim() > sv.dim():
        return False
    tail = sv.shape[sv.dim() - tv.dim() :]
    return all(str(a) == "1" or str(a) == str(b) for a, b in zip(tv.shape, tail, strict=True))
