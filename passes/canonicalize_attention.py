"""canonicalize_attention: after this pass every provably causal attention is one node,
``aten.scaled_dot_product_attention(q, k, v, None, dropout_p, True, scale=…)``, marked
``meta["autopart.attention"] = "causal"``; a causal attention within a sliding window of W keys
is ``scaled_dot_product_attention(q, k, v, lower_right_mask(q, k, W), dropout_p, False, …)``,
marked the same and with ``meta["autopart.window"] = W``; any other attention is marked with
why it is not.

Recognized forms:

1. ``scaled_dot_product_attention(..., is_causal=True)`` — already canonical;
2. ``scaled_dot_product_attention`` with a mask built in the graph (as Hugging Face models do);
3. the manual path ``matmul(q, kᵀ) [· c | ÷ c] → masked_fill(mask, −inf) or + additive mask →
   softmax → [casts] [dropout] [casts] → matmul(·, v)`` (nanoGPT, GPT-J, eager Hugging Face
   attention), replaced by SDPA in q's dtype with the graph's scale (1 when unscaled).

Seq1F1B plans also get attention whose scores are modified by causal functions of positions
(``position_masks`` proves each by evaluation and rebuilds its terms from q's and k's sizes):

4. an SDPA whose mask is such a function (Llama 4's chunked attention): the mask rebuilt;
5. ``softmax(q·kᵀ · c + terms)`` with additive terms, fills and clamps at ≤ −1e4 (ALiBi,
   XGLM's clamp; heads may be folded into the batch): SDPA with the terms as its mask;
6. ``softmax(f(q·kᵀ))`` with f elementwise (soft-capping) and at most one sink column: the
   model's nodes, marked ``meta["autopart.scores"]``; the product with v is the attention;
7. an SDPA whose mask is a per-key bias computed from the keys' tokens, filled at ≤ −1e4 where
   a position mask hides the key (Doge's dynamic mask): the bias becomes one more column of k
   (and a column 1/scale of q), the mask the position mask alone (``_key_bias``), so the K
   prefix carries the earlier keys' biases;
8. ``matmul(f(q·kᵀ), v)`` with no softmax, f elementwise in the scores with terms that are
   functions of positions (MiniMax's lightning attention within a block: q·kᵀ times a decay
   table that is 0 above the diagonal): the model's nodes, marked like form 6, once f is proven
   to be exactly 0 at every later key and exactly a function of positions (no per-row
   constant: nothing normalizes the rows).

A mask is proven causal by evaluation, not by pattern: its construction (which must not
depend on parameters) is cut out of the graph and run at several sequence lengths with
random token ids, just past every length the construction names (a sliding window of 4096
keys differs from causal only at 4097 tokens), and at the longest sequence the program will
take (``position_masks.proof_length``: a window no integer names shows there); only if it
equals the lower-triangular causal mask every time, or that mask within the window of W keys it
shows at the longest length tried, is it replaced. A graph relying on such a proof is marked
``META_PROVEN_SEQ``: compile lowers ``Plan.max_seq`` to that length, past which nothing was
proven. A
padding or bidirectional mask fails that test and stays; so does a softmax over scores the
forms above do not cover. ``require_causal`` refuses a graph with attention it could not
prove causal.

Which plans: the Seq1F1B schedules (which need one attention form) get all of the above. Every
other plan gets form 2 only, without windows: an SDPA whose mask is proven plainly causal drops
the mask for ``is_causal=True`` — the same operation, minus an [S, S] mask in memory, and on a
GPU the flash kernels, which take no mask. The manual path is left alone there (its dropout is
autopart's explicit, reproducible one; SDPA's would draw from torch's generator). One exception:
a tp plan also gets form 5 for an attention whose heads are folded into the batch and that has no
dropout (BLOOM), with the reshapes that fold q, k, v and the output taken out, so that tp can
split its heads (folded, the heads are the inner part of the first dim, which no tp layout
describes, and the attention stayed replicated).
"""

from __future__ import annotations

import math
import operator
from typing import Any, cast

import sympy
import torch
from torch import fx

from autopart.errors import AutopartError
from autopart.frontend.capture import OPTIONAL, B, S, to_sympy
from autopart.frontend.shapes import propagate
from autopart.graph import (
    cuts_last_column,
    erase_unused,
    only_user,
    reaches,
    remove_dead,
    row_max_of,
)
from autopart.layout import Plan
from autopart.meta import (
    META_ATTENTION,
    META_BUFFERS,
    META_DATA_MASK,
    META_INPUT,
    META_MASK_FN,
    META_MODULE,
    META_PROOFS,
    META_PROVEN_SEQ,
    META_SCORES,
    META_WINDOW,
)
from autopart.node_args import float_arg, int_arg, node_arg, seq_arg, whole_slice
from autopart.passes.position_masks import (
    MASKED,
    Proofs,
    discard,
    local_mask,
    place,
    proof_length,
    proof_lengths,
    prove,
    prove_scores,
    reads_length,
    said,
    score_window,
    signature,
    sym_size,
)

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_SIZES = (3, 5, 8, 13)


def canonicalize_attention(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    every_form = plan.chunked  # else: masked SDPA only (docstring)
    changed = proven = False
    proofs = Proofs(proof_length(gm, plan), gm.meta.get(META_PROOFS, {}))
    if every_form:
        changed |= _scalar_factors(gm)
        changed |= _written_softmaxes(gm)
        changed |= _key_transposes(gm)
        if _sink_scales(gm):
            changed = True
            remove_dead(gm)
            propagate(gm)
    for n in list(gm.graph.nodes):
        if n._erased:  # a product with v an earlier form replaced
            continue
        if n.target == SDPA:
            changed |= every_form and _key_bias(gm, n)
            proven |= _sdpa(gm, n, proofs, windows=every_form)
        elif every_form and n.target in (aten.softmax.int, aten._softmax.default):
            proven |= _manual(gm, n, proofs) or _scored(gm, n, proofs)
        elif plan.mesh.tp > 1 and n.target in (aten.softmax.int, aten._softmax.default):
            proven |= _scored(gm, n, proofs, folded_only=True)
        elif every_form and n.target in _PRODUCTS and not n.meta.get(META_SCORES):
            proven |= _linear(gm, n, proofs)
    if proven:  # the program relies on proofs that hold up to this length
        gm.meta[META_PROVEN_SEQ] = proofs.longest
    if changed or proven:
        remove_dead(gm)
        propagate(gm)
    return gm


def _key_transposes(gm: fx.GraphModule) -> bool:
    """Write a q·kᵀ whose kᵀ is one permute of the projection (GPT-1's
    ``k.permute(0, 2, 3, 1)``) as a permute to [b, h, s, d] and a transpose of its last two
    dims: the same values, with a K the chunk pass can extend by a prefix."""
    changed = False
    for n in list(gm.graph.nodes):
        kt = n.args[1] if n.target == aten.matmul.default and len(n.args) == 2 else None
        if not isinstance(kt, fx.Node) or kt.target != aten.permute.default:
            continue
        perm = [int(d) for d in cast("list[int]", kt.args[1])]
        if len(perm) != 4 or not _over_keys(gm, n):
            continue
        g = gm.graph
        with g.inserting_before(n):
            k = g.call_function(aten.permute.default, (kt.args[0], [*perm[:2], perm[3], perm[2]]))
            t = g.call_function(aten.transpose.int, (k, -2, -1))
        for m in (k, t):
            m.meta.update({key: v for key, v in kt.meta.items() if key != "val"})
        v = kt.args[0].meta["val"] if isinstance(kt.args[0], fx.Node) else None
        if v is None:
            continue
        k.meta["val"] = v.permute(*perm[:2], perm[3], perm[2])
        t.meta["val"] = k.meta["val"].transpose(-2, -1)
        n.replace_input_with(kt, t)
        changed = True
    return changed


def _scalar_factors(gm: fx.GraphModule) -> bool:
    """Write scores scaled by one number computed from parameters (a learned temperature,
    ``(q @ kᵀ) * self.temp``) as the product of the scaled queries, ``(q * temp) @ kᵀ``: the
    same values (up to rounding), with a factor the forms below need not read (they refuse a
    score function that reads a parameter). Only for a product with no other reader."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.target not in (aten.mul.Tensor, aten.div.Tensor) or len(n.args) != 2:
            continue
        product, factor = n.args
        if not isinstance(product, fx.Node) or not isinstance(factor, fx.Node):
            continue
        val = factor.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() != 1 or _values_read(factor):
            continue
        if not _is_product(product) or len(product.users) != 1 or not _over_keys(gm, product):
            continue
        q = node_arg(product, 0)
        with gm.graph.inserting_before(product):
            scaled = gm.graph.call_function(n.target, (q, factor))
        scaled.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        product.replace_input_with(q, scaled)
        n.replace_all_uses_with(product)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        propagate(gm)
    return changed


def _written_softmaxes(gm: fx.GraphModule) -> bool:
    """Write a softmax over the last dim written out by hand, ``e / e.sum(-1, keepdim=True)``
    with ``e = exp(x − max(x, −1, keepdim=True))`` (the max may be ``amax``, ``max(...)[0]``,
    detached, or absent), as ``softmax(x, −1)``: the same values (softmax is that quotient,
    shifted by the row's max), which the forms below then recognize. Only when ``e`` and its
    sum feed nothing else."""
    changed = False
    for div in list(gm.graph.nodes):
        if div.target != aten.div.Tensor or div._erased:
            continue
        e, total = div.args[0], div.args[1]
        if not isinstance(e, fx.Node) or not isinstance(total, fx.Node):
            continue
        if e.target != aten.exp.default or set(e.users) != {div, total}:
            continue
        if total.target != aten.sum.dim_IntList or total.kwargs or len(total.users) != 1:
            continue
        if total.args[0] is not e or not _last_dim_kept(total, e):
            continue
        x = node_arg(e, 0)
        if x.target == aten.sub.Tensor and _row_max(x.args[1], x.args[0]):
            x = node_arg(x, 0)
        with gm.graph.inserting_before(div):
            sm = gm.graph.call_function(aten.softmax.int, (x, -1))
        sm.meta.update({k: v for k, v in div.meta.items() if k != "val"})
        sm.meta["val"] = div.meta["val"]
        div.replace_all_uses_with(sm)
        changed = True
    return changed


def _last_dim_kept(reduction: fx.Node, x: fx.Node) -> bool:
    """``reduction`` reduces ``x`` over its last dim only, keeping it."""
    dims, keep = reduction.args[1], reduction.args[2] if len(reduction.args) > 2 else False
    last = x.meta["val"].dim() - 1
    return (
        keep is True
        and isinstance(dims, (list, tuple))
        and [d % (last + 1) for d in dims] == [last]
    )


def _row_max(m: object, x: object) -> bool:
    """``m`` is the max of ``x`` over its last dim, kept (``amax``, ``max(...)[0]``), maybe
    detached."""
    while isinstance(m, fx.Node) and m.target in (aten.detach.default, aten.alias.default):
        m = m.args[0]
    if not isinstance(m, fx.Node) or not isinstance(x, fx.Node):
        return False
    if m.target == aten.amax.default:
        return m.args[0] is x and _last_dim_kept(m, x)
    if m.target is operator.getitem and m.args[1] == 0:
        mx = m.args[0]
        if isinstance(mx, fx.Node) and mx.target == aten.max.dim and mx.args[0] is x:
            d, keep = mx.args[1], mx.args[2] if len(mx.args) > 2 else False
            return (
                keep is True
                and isinstance(d, int)
                and d % x.meta["val"].dim() == x.meta["val"].dim() - 1
            )
    return False


def _sink_scales(gm: fx.GraphModule) -> bool:
    """Write a sink applied after the softmax (Granite SWA: ``softmax(x)·v ×
    sigmoid(logsumexp(x) − c)``, c a per-head sink) as form 6's sink column,
    ``softmax(cat([x, c], -1))[..., :-1]·v``: the same values, since sigmoid(l − c) =
    eˡ / (eˡ + eᶜ) and eˡ = Σⱼ e^xⱼ. Only when the logsumexp and the sigmoid feed nothing else,
    x's softmax over its last dim is the one the product with v takes, and c is computed
    without the tokens and has one value per row (a column)."""
    g, changed = gm.graph, False
    for lse in list(g.nodes):
        if lse.target != aten.logsumexp.default or lse._erased:
            continue
        x = node_arg(lse, 0)
        dims, keep = list(seq_arg(lse, 1)), lse.args[2] if len(lse.args) > 2 else False
        if x.meta["val"].dim() != 4 or dims not in ([-1], [3]) or keep:
            continue
        before, sub, _ = _through_casts(lse)
        if sub is None or sub.target != aten.sub.Tensor or sub.args[0] is not before:
            continue
        if before.meta["val"].dim() != lse.meta["val"].dim():  # c must meet [b, h, s]
            continue
        c = sub.args[1]
        if not isinstance(c, fx.Node) or _values_read(c) or c.meta["val"].dim() > 3:
            continue
        if c.meta["val"].dim() == 3 and c.meta["val"].shape[-1] != 1:
            continue
        _, sigmoid, _ = _through_casts(sub)
        if sigmoid is None or sigmoid.target != aten.sigmoid.default:
            continue
        _, mul, unsqueezed = _through_casts(sigmoid)
        if mul is None or mul.target != aten.mul.Tensor or not unsqueezed:
            continue
        softmaxes = [
            u
            for u in x.users
            if u.target in (aten.softmax.int, aten._softmax.default) and u.args[1] in (-1, 3)
        ]
        if len(softmaxes) != 1:
            continue
        sm = softmaxes[0]
        pv, _, _ = _probabilities(sm)
        if pv is None or pv not in mul.args or pv.meta["val"].shape != mul.meta["val"].shape:
            continue
        with g.inserting_before(sm):
            col = c if c.meta["val"].dim() == 3 else None
            if col is None:  # [h] or a scalar: one value per head or for all
                col = g.call_function(aten.view.default, (c, [1, -1, 1]))
            col = g.call_function(aten.unsqueeze.default, (col, -1))
            sizes: list[Any] = [_sym(g, x, 0), int(x.meta["val"].shape[1]), _sym(g, x, 2), 1]
            col = g.call_function(aten.expand.default, (col, sizes))
            if c.meta["val"].dtype != x.meta["val"].dtype:
                col = g.call_function(aten._to_copy.default, (col,), {"dtype": x.meta["val"].dtype})
            joined = g.call_function(aten.cat.default, ([x, col], -1))
        sm.replace_input_with(x, joined)
        with g.inserting_after(sm):
            cut = g.call_function(aten.slice.Tensor, (sm, -1, 0, -1))
        for u in [u for u in sm.users if u is not cut]:
            u.replace_input_with(sm, cut)
        mul.replace_all_uses_with(pv)
        changed = True
    return changed


def _through_casts(n: fx.Node) -> tuple[fx.Node, fx.Node | None, bool]:
    """From ``n`` down its only users through casts and unsqueezes: (the last of those, the
    first user past them, whether an unsqueeze of the last dim was passed)."""
    last, user, unsqueezed = n, only_user(n), False
    while user is not None and (user.target in _CASTS or user.target == aten.unsqueeze.default):
        unsqueezed |= user.target == aten.unsqueeze.default and user.args[1] in (-1, 3)
        last, user = user, only_user(user)
    return last, user, unsqueezed


def require_causal(gm: fx.GraphModule) -> None:
    """Refuse a graph with attention that is not (provably) causal."""
    for n in gm.graph.nodes:
        why = n.meta.get(META_ATTENTION)
        if why is not None and why != "causal":
            raise AutopartError(
                f"attention {n.name} ({n.meta.get(META_MODULE) or '<root>'}) is {why}",
                hint="Seq1F1B needs purely causal attention; use 1f1b or interleaved-1f1b for this model",
            )


def _sdpa(gm: fx.GraphModule, n: fx.Node, proofs: Proofs, windows: bool = True) -> bool:
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    causal = n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal", False)
    if mask is None:
        n.meta[META_ATTENTION] = "causal" if causal else "not causal: no mask and is_causal=False"
        return False
    assert isinstance(mask, fx.Node)  # attn_mask: Tensor?
    names = batch_inputs(gm, mask)
    if names:  # the batch's padding or documents: kept as the model built it (module doc)
        keep_is_true = mask.meta["val"].dtype == torch.bool
        why = _data_proof(gm, proofs, mask, names, keep_is_true) if windows else None
        if windows and why is None and not causal:
            n.meta[META_ATTENTION] = "causal"  # document-causal: sequence_chunk rebuilds it
            n.meta[META_DATA_MASK] = names
            return True  # on the proof
        n.meta[META_ATTENTION] = why or f"masked by the batch's {' and '.join(names)}"
        return False
    # a float mask is added to the scores: only 0 (kept) and at most MASKED (dropped) are a
    # mask; any other value is a bias, which _position_mask proves or refuses (read as "0 is
    # kept, anything else dropped", an ALiBi bias was a window of 1 key and chunked silently
    # wrong: helper probe, twenty-third session)
    keep_is_true = mask.meta["val"].dtype == torch.bool
    why, window = _causal_window(
        gm, proofs, mask, keep_is_true=keep_is_true, additive=not keep_is_true
    )
    if why and windows:  # a causal function of positions (chunked, ...), rebuilt in place
        return _position_mask(gm, n, mask, why, proofs)
    n.meta[META_ATTENTION] = why or "causal"
    if why or (window is not None and not windows):
        return False
    q, k, v = n.args[:3]
    dropout = float_arg(n, 4, "dropout_p", 0.0)
    _replace(gm, n, q, k, v, dropout, cast("float | None", n.kwargs.get("scale")), window)
    return True


_CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
# ops that copy or repeat a mask along its batch and head dims (a GQA repeat, a whole slice)
_HEAD_CHAIN = (
    aten.unsqueeze.default,
    aten.expand.default,
    aten.reshape.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.clone.default,
    aten.slice.Tensor,
)


def _key_bias(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Form 7: SDPA(q, k, v, chain(masked_fill(expand(X), C, low))), X ``[..., 1, Lk]`` one bias
    per key (and head) and ``chain`` a repeat over batch and heads, becomes
    SDPA([q, 1/scale], [k, chain(X)ᵀ], v, chain(~C), scale): the same scores where C keeps a
    key (q·kᵀ·scale + X_j), −inf where the original had ``low`` (both weight 0: ``MASKED``).
    The bias then travels with k, so a chunk's K prefix holds the earlier keys' biases; the
    boolean position mask ~C is proven and rebuilt by ``_sdpa`` like any other."""
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    if not isinstance(mask, fx.Node) or len(n.args) > 5 and n.args[5]:
        return False
    chain, x = [], mask
    while x.target in _HEAD_CHAIN and not _fill_of(x):
        if x.target == aten.slice.Tensor and not whole_slice(x):
            return False
        if _last_two(x) != _last_two(node_arg(x, 0)):
            return False  # it moves the query or key dim: not a repeat over batch and heads
        chain.append(x)
        x = node_arg(x, 0)
    filled = _fill_of(x)
    if filled is None:
        return False
    e, hidden = filled
    bias = e
    while bias.target in (aten.expand.default, aten.slice.Tensor) and (
        bias.target != aten.slice.Tensor or whole_slice(bias)
    ):
        bias = node_arg(bias, 0)
    val, q, k = bias.meta.get("val"), node_arg(n, 0), node_arg(n, 1)
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.shape[-2] != 1:
        return False  # not one value per key: the query dim is not broadcast
    if e.meta["val"].dim() != val.dim() or val.shape[-1] != e.meta["val"].shape[-1]:
        return False
    qd = q.meta["val"].shape[-1]
    given = n.kwargs.get("scale")
    scale = float(given) if isinstance(given, (int, float)) else 1.0 / math.sqrt(int(qd))
    g = gm.graph
    sized = (
        aten.expand.default,
        aten.reshape.default,
        aten.view.default,
        aten._unsafe_view.default,
    )
    existing = set(g.nodes)
    with g.inserting_before(n):
        keep = g.call_function(aten.bitwise_not.default, (hidden,))
        column = bias
        for c in reversed(chain):  # the same repeat over heads, with one query row
            target = cast("Any", c.target)
            args = list(c.args[1:])
            if target in sized:
                shape = list(seq_arg(c, 1))
                args[0] = [*shape[:-2], 1, shape[-1]]
            column = g.call_function(target, (column, *args), dict(c.kwargs))
            keep = g.call_function(target, (keep, *c.args[1:]), dict(c.kwargs))
        column = g.call_function(aten.squeeze.dim, (column, -2))
        column = g.call_function(aten.unsqueeze.default, (column, -1))
        column = g.call_function(aten._to_copy.default, (column,), {"dtype": k.meta["val"].dtype})
        k2 = g.call_function(aten.cat.default, ([k, column], -1))
        one = g.call_function(aten.slice.Tensor, (q, -1, 0, 1))
        one = g.call_function(aten.full_like.default, (one, 1.0 / scale))
        q2 = g.call_function(aten.cat.default, ([q, one], -1))
    # the nodes made here, and only those (an earlier rewrite's node without a value yet was
    # erased with them when this form did not apply, though the attention still read it:
    # Falcon with ALiBi crashed the pass)
    made = [m for m in g.nodes if m not in existing]
    for m in made:
        m.meta.update({key: v for key, v in n.meta.items() if key != "val"})
    before = (n.args, n.kwargs)
    n.args = (q2, k2, *n.args[2:3], keep, *n.args[4:])
    n.kwargs = {key: v for key, v in n.kwargs.items() if key != "attn_mask"} | {"scale": scale}
    try:
        propagate(gm)  # the new nodes' values, before the mask is proven
    except Exception:  # noqa: BLE001 - the repeat does not apply to one query row: not this form
        n.args, n.kwargs = before
        for m in reversed(made):
            g.erase_node(m)
        propagate(gm)
        return False
    return True


def _last_two(x: fx.Node) -> str:
    val = x.meta.get("val")
    return str(tuple(val.shape[-2:])) if isinstance(val, torch.Tensor) and val.dim() >= 2 else ""


def _fill_of(x: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(values, hidden) when ``x`` is ``masked_fill(values, hidden, low)`` or
    ``where(hidden, low, values)``, low ≤ ``MASKED``."""
    if x.target == aten.masked_fill.Scalar and _low(x.args[2]):
        return node_arg(x, 0), node_arg(x, 1)
    if x.target == aten.where.ScalarSelf and _low(x.args[1]):
        return node_arg(x, 2), node_arg(x, 0)
    return None


def _manual(gm: fx.GraphModule, sm: fx.Node, proofs: Proofs) -> bool:
    """softmax(mask(matmul(q, kᵀ) [·/÷ c])) [→ casts] [→ dropout] [→ casts] → matmul(·, v),
    where mask is ``masked_fill(·, m, −inf)`` or ``· + m`` with an additive mask (0 where kept,
    ≤ −1e4 where not: GPT-J, GPT-2's eager path). A softmax of anything else (soft-capped
    logits, ALiBi biases) is left as it is."""
    filled = node_arg(sm, 0)
    if sm.args[1] not in (-1, filled.meta["val"].dim() - 1):
        return False
    if filled.target == aten.masked_fill.Scalar and filled.args[2] == float("-inf"):
        scores, cond, additive = node_arg(filled, 0), node_arg(filled, 1), False
    elif filled.target == aten.add.Tensor and all(isinstance(a, fx.Node) for a in filled.args):
        scores, cond = node_arg(filled, 0), node_arg(filled, 1)
        if _qk(scores) is None:
            scores, cond = cond, scores
        additive = True
    else:
        return False
    qk = _qk(scores)
    if qk is None:
        return False
    q, k, scale = qk
    probs, dropout = sm, 0.0
    user = only_user(probs)
    while user is not None and user.target in _CASTS:
        probs, user = user, only_user(user)
    if user is not None and user.target == aten.dropout.default:
        probs, dropout = user, (float_arg(user, 1) if user.args[2] else 0.0)
        user = only_user(probs)
    while user is not None and user.target in _CASTS:
        probs, user = user, only_user(user)
    if user is None or user.target != aten.matmul.default or user.args[0] is not probs:
        return False
    names = batch_inputs(gm, cond)
    if names:  # Seq1F1B rebuilds only an SDPA's mask from the batch
        sm.meta[META_ATTENTION] = (
            f"a softmax attention masked by the batch's {' and '.join(names)} (Seq1F1B "
            "chunks such a mask in scaled_dot_product_attention only)"
        )
        return False
    why, window = (
        _causal_window(gm, proofs, cond, keep_is_true=True, additive=True)
        if additive
        else _causal_window(gm, proofs, cond, keep_is_true=False)
    )
    sm.meta[META_ATTENTION] = why or "causal"
    if why:
        return False
    _replace(gm, user, q, k, user.args[1], dropout, scale, window)
    return True


def _position_mask(gm: fx.GraphModule, n: fx.Node, mask: fx.Node, why: str, proofs: Proofs) -> bool:
    """An SDPA whose mask is neither causal nor a window, but a causal function of positions
    (Llama 4's chunked attention, a bias): the mask rebuilt from q's and k's sizes
    (``position_masks``), if ``prove`` holds; else the SDPA keeps ``why``."""
    q, k = node_arg(n, 0), node_arg(n, 1)
    additive = mask.meta["val"].dtype != torch.bool
    local = local_mask(gm, mask, q, k, before=n)
    proof = (
        local
        if isinstance(local, str)
        else proofs.once(
            _key("mask", additive, signature(gm, local)),
            lambda: prove(gm, local, additive, longest=proofs.longest),
        )
    )
    if proof is not None:
        if not isinstance(local, str):
            discard(gm, local)
        n.meta[META_ATTENTION] = f"{why}, and not a causal function of positions: {proof}"
        return False
    assert not isinstance(local, str)
    n.replace_input_with(mask, local)
    place(_marked(local), n)
    n.meta[META_ATTENTION], n.meta[META_MASK_FN] = "causal", True
    return True


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default)
_PRODUCTS = (aten.matmul.default, aten.bmm.default)


def _scored(gm: fx.GraphModule, sm: fx.Node, proofs: Proofs, folded_only: bool = False) -> bool:
    """softmax(scores · c + position terms) [→ casts] [→ dropout] [→ casts] [→ views] →
    matmul/bmm(·, v), where the terms are biases and masks added, filled or clamped at
    ≤ ``MASKED`` (BLOOM's and MPT's ALiBi, XGLM's clamp at the float minimum; heads may be
    folded into the batch), becomes SDPA with an additive mask: the terms evaluated with the
    scores at 0, rebuilt from q's and k's sizes and proven a causal function of positions
    (``position_masks``). Exact: softmax(x · c + m) for the additive m the chain adds. A
    multiplicative or nonlinear term (GPT-1's scores × mask, soft-capping's tanh) is not such
    a chain, and the softmax keeps why.

    ``folded_only`` (tp plans that are not Seq1F1B): only an attention with its heads folded
    into the batch and no dropout, so that tp can split its heads (folded, the heads are the
    inner part of the first dim, which no tp layout describes); the q, k, v and output reshapes
    that fold them are taken out (``_unfold``, ``_unfolded_users``)."""
    x = node_arg(sm, 0)
    if sm.args[1] not in (-1, x.meta["val"].dim() - 1) or not _over_keys(gm, x):
        return False
    scaled, why = _chain(gm, x)
    if scaled is None:
        if why and not folded_only:
            return _score_function(gm, sm, why, proofs)
        return False
    product, scale = scaled, 1.0
    if scaled.target in (aten.mul.Tensor, aten.div.Tensor):
        c = float(cast(float, scaled.args[1]))
        product, scale = (
            _below(node_arg(scaled, 0)),
            (c if scaled.target == aten.mul.Tensor else 1 / c),
        )
    q, k = node_arg(product, 0), node_arg(node_arg(product, 1), 0)
    if folded_only and q.meta["val"].dim() != 3:
        return False
    pv, probs, dropout = _probabilities(sm)
    if pv is None or (folded_only and dropout):
        return False
    v = node_arg(pv, 1)
    g = gm.graph
    made: list[fx.Node] = []
    with g.inserting_before(pv):
        if q.meta["val"].dim() == 3:  # heads folded into the batch: [h·b, s, d] → [b, h, s, d]
            # (v may be unfolded already: GPT-NeoX-Japanese)
            unfolded = _unfold(gm, (q, k, v), made)
            if unfolded is None:
                sm.meta[META_ATTENTION] = "an attention whose heads are folded unevenly"
                return False
            q4, k4, v4 = unfolded
        else:
            q4, k4, v4 = q, k, v
    zeros = _zeros_like(gm, scaled, q4, k4, before=pv)
    mask = local_mask(gm, x, q4, k4, before=pv, replace={scaled: zeros})
    if not isinstance(mask, str):
        with g.inserting_before(pv):
            if x.meta["val"].dim() == 3:  # the folded scores' mask, per head
                b, h = _sym(g, q4, 0), q4.meta["val"].shape[1]
                shape: list[Any] = [b, int(h), _sym(g, q4, -2), sym_size(g, k4, -2, "keys")]
                mask = g.call_function(aten.reshape.default, (mask, shape))
                mask.meta[META_MASK_FN] = True
            dtype = q.meta["val"].dtype
            if x.meta["val"].dtype != dtype:
                mask = g.call_function(aten._to_copy.default, (mask,), {"dtype": dtype})
                mask.meta[META_MASK_FN] = True
    proof = (
        mask
        if isinstance(mask, str)
        else proofs.once(
            _key("mask", True, signature(gm, mask)),
            lambda: prove(gm, mask, additive=True, longest=proofs.longest),
        )
    )
    if proof is not None:
        if not isinstance(mask, str):
            discard(gm, mask)
        discard(gm, zeros)
        for m in reversed(made):
            if not m.users:
                g.erase_node(m)
        sm.meta[META_ATTENTION] = f"not a causal function of positions: {proof}"
        return False
    assert not isinstance(mask, str)
    with g.inserting_before(pv):
        vv = v4
        if v4.meta["val"].dtype != q.meta["val"].dtype:
            vv = g.call_function(aten._to_copy.default, (v4,), {"dtype": q.meta["val"].dtype})
        new = g.call_function(SDPA, (q4, k4, vv, mask, float(dropout), False), {"scale": scale})
        new.meta.update({key: val for key, val in pv.meta.items() if key != "val"})
        out = new
        if pv.meta["val"].dtype != q.meta["val"].dtype:
            out = g.call_function(aten._to_copy.default, (out,), {"dtype": pv.meta["val"].dtype})
        folded_out = pv.meta["val"].dim() == 3
        if folded_out:
            folded: list[Any] = [_sym(g, q, 0), _sym(g, q, 1), int(v.meta["val"].shape[-1])]
            out = g.call_function(aten.reshape.default, (out, folded))
    new.meta[META_ATTENTION], new.meta[META_MASK_FN], new.meta[META_WINDOW] = "causal", True, None
    place([*made, new, out, vv, *_marked(mask)], pv)
    pv.replace_all_uses_with(out)
    erase_unused(g, pv)
    if folded_out:
        want = q4.meta["val"].shape[:-1] + v4.meta["val"].shape[-1:]
        _unfolded_users(g, out, new, torch.empty(want, device="meta"))
    return True


def _unfolded_users(g: fx.Graph, out: fx.Node, new: fx.Node, unfolded: torch.Tensor) -> None:
    """A user of the folded output ``out`` that reshapes it back to [b, h, s, d] (BLOOM's merge
    of heads; ``unfolded``: a tensor of that shape) takes the SDPA's ``new`` itself: a reshape
    of a reshape is a reshape of the first tensor, and one to its own shape is that tensor."""
    for user in list(out.users):
        if (
            user.target in _VIEWS
            and user.target != aten.clone.default
            and _same_shape_as(user, unfolded)
        ):
            user.replace_all_uses_with(new)
            g.erase_node(user)
    erase_unused(g, out)  # once its users are gone: it and the reshape's sizes


def _same_shape_as(a: fx.Node, want: torch.Tensor) -> bool:
    """``a`` holds a tensor of ``want``'s shape (symbolic sizes compared as expressions)."""
    va = a.meta.get("val")
    if not isinstance(va, torch.Tensor) or va.dim() != want.dim():
        return False
    return all(str(x) == str(y) for x, y in zip(va.shape, want.shape, strict=True))


def _marked(mask: fx.Node) -> list[fx.Node]:
    """The nodes of a rebuilt mask (``META_MASK_FN``)."""
    seen, stack = [], [mask]
    while stack:
        n = stack.pop()
        if n.meta.get(META_MASK_FN) and n not in seen:
            seen.append(n)
            stack.extend(n.all_input_nodes)
    return seen


_UNARY = (aten.tanh.default, aten.neg.default)
_SCALAR_OPS = (aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor)
_TERM_OPS = (
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.masked_fill.Scalar,
    aten.where.ScalarOther,
    aten.max.other,
    aten.maximum.default,
)


def _score_function(gm: fx.GraphModule, sm: fx.Node, why: str, proofs: Proofs) -> bool:
    """The general form: softmax(f(q·kᵀ)) → [casts, dropout, the sink column cut off] →
    matmul(·, v), with f elementwise in the scores — scalar arithmetic, ``tanh`` (Gemma 2's
    soft-capping), terms added, multiplied, filled or clamped from position tensors — and at
    most one sink column (gpt-oss: ``cat([scores, sinks], -1)``; its row max subtracted is
    dropped, softmax subtracts its own). The model's nodes stay; each term is rebuilt from q's
    and k's sizes (``position_masks.local_mask``), and f is proven, on random scores, to hide
    every later key and to be a function of positions (``position_masks.prove_scores``). The
    nodes are marked ``META_SCORES`` ("qk", "mod", "pv"), the product with v ``"causal"``: the
    chunk pass gives it a K/V prefix like an SDPA."""
    x = node_arg(sm, 0)
    if x.meta["val"].dim() != 4:
        sm.meta[META_ATTENTION] = f"not a recognized attention: {why}"
        return False
    mods, terms, sink, shift, product, fail = [], [], None, None, None, None
    n = x
    for _ in range(48):
        if _is_product(n) and n.meta["val"].dim() == 4:
            product = n
            break
        mods.append(n)
        if _through(n):
            n = node_arg(n, 0)
            continue
        joined = n.args[0] if n.target == aten.cat.default else None
        if isinstance(joined, (list, tuple)) and len(joined) == 2 and int_arg(n, 1) in (-1, 3):
            path, extra = cast("tuple[fx.Node, fx.Node]", tuple(joined))
            if sink is not None or _reaches_product(extra) or extra.meta["val"].shape[-1] != 1:
                fail = f"{n.name} joins more than one sink column to the scores"
                break
            if _values_read(extra):  # the prover does not look inside the attention
                fail = f"{n.name} joins a sink column computed from the tokens"
                break
            sink, n = extra, path
            continue
        paths = [a for a in n.all_input_nodes if _reaches_product(a)]
        if n.target == aten.sub.Tensor and row_max_of(n.args[1], n.args[0]):
            shift, n = n, node_arg(n, 0)
            continue
        if len(paths) != 1 or n.target not in _TERM_OPS:
            fail = f"{n.name} ({_name(n)}) is not elementwise in the scores"
            break
        terms += [(n, a) for a in n.all_input_nodes if a is not paths[0]]
        n = paths[0]
    pv, probs, dropout = _probabilities(sm, sink_column=sink is not None)
    if product is None or fail or pv is None or pv.meta["val"].dim() != 4:
        sm.meta[META_ATTENTION] = f"not a recognized attention: {fail or why}"
        return False
    q, k = node_arg(product, 0), node_arg(node_arg(product, 1), 0)
    rebuilt = _rebuild(gm, terms, q, k, product)
    if isinstance(rebuilt, str):
        sm.meta[META_ATTENTION] = f"not a causal function of positions: {rebuilt}"
        return False
    key = signature(gm, x, product, sink)
    proof = proofs.once(
        _key("scores", False, key), lambda: prove_scores(gm, x, product, proofs.longest, sink)
    )
    window = (
        proofs.once(
            _key("window", False, key),
            lambda: score_window(gm, x, product, proofs.longest, sink),
        )
        if proof is None
        else None
    )
    if isinstance(window, str):
        proof, window = window, None
    if proof is not None:
        _restore(gm, rebuilt, terms)
        sm.meta[META_ATTENTION] = f"not a causal function of positions: {proof}"
        return False
    if shift is not None:  # softmax subtracts its own row max
        shift.replace_all_uses_with(node_arg(shift, 0))
    for m in rebuilt.values():
        place(_marked(m), product)
    product.meta[META_SCORES] = "qk"
    for m in (*mods, sm, *_between(sm, pv)):
        m.meta[META_SCORES] = "mod"
    pv.meta[META_SCORES], pv.meta[META_ATTENTION] = "pv", "causal"
    _mark_window(window, [product, *mods, sm, *_between(sm, pv), pv])
    return True


def _mark_window(window: int | None, nodes: list[fx.Node]) -> None:
    """``META_WINDOW`` on every node of a general-form attention with a sliding ``window``
    (``position_masks.score_window``): the chunk pass trims its K/V prefix to the window, the
    cost model counts its quadratic FLOPs as W keys per query."""
    for m in nodes if window is not None else ():
        m.meta[META_WINDOW] = window


def _linear(gm: fx.GraphModule, pv: fx.Node, proofs: Proofs) -> bool:
    """Form 8 (module docstring): ``pv`` = matmul(f(q·kᵀ), v), f elementwise with position
    terms and no softmax. A product whose left side is not such a chain is left alone (the
    Seq1F1B rules refuse it if it pairs tokens); a chain that is, but is not proven, is marked
    with why."""
    x = node_arg(pv, 0)
    if pv.meta["val"].dim() != 4 or x.meta["val"].dim() != 4 or not _over_keys(gm, x):
        return False
    mods, terms, product, n = [], [], None, x
    for _ in range(48):
        if _is_product(n) and n.meta["val"].dim() == 4:
            product = n
            break
        mods.append(n)
        if _through(n):
            n = node_arg(n, 0)
            continue
        paths = [a for a in n.all_input_nodes if _reaches_product(a)]
        if len(paths) != 1 or n.target not in _TERM_OPS:
            return False  # not elementwise in the scores (a softmax's product, say)
        terms += [(n, a) for a in n.all_input_nodes if a is not paths[0]]
        n = paths[0]
    if product is None:
        return False
    q, k = node_arg(product, 0), node_arg(node_arg(product, 1), 0)
    rebuilt = _rebuild(gm, terms, q, k, product)
    if isinstance(rebuilt, str):
        pv.meta[META_ATTENTION] = f"not a causal function of positions: {rebuilt}"
        return False
    key = signature(gm, x, product)
    proof = proofs.once(
        _key("scores", True, key),
        lambda: prove_scores(gm, x, product, proofs.longest, linear=True),
    )
    window = (
        proofs.once(
            _key("window", True, key),
            lambda: score_window(gm, x, product, proofs.longest, linear=True),
        )
        if proof is None
        else None
    )
    if isinstance(window, str):
        proof, window = window, None
    if proof is not None:
        _restore(gm, rebuilt, terms)
        pv.meta[META_ATTENTION] = f"a linear attention that is not causal: {proof}"
        return False
    for m in rebuilt.values():
        place(_marked(m), product)
    product.meta[META_SCORES] = "qk"
    for m in mods:
        m.meta[META_SCORES] = "mod"
    pv.meta[META_SCORES], pv.meta[META_ATTENTION] = "pv", "causal"
    _mark_window(window, [product, *mods, pv])
    return True


def _through(n: fx.Node) -> bool:
    """A cast, ``tanh``/``neg``, or arithmetic with a scalar: f passes through to its input."""
    scalar = n.target in _SCALAR_OPS and not isinstance(n.args[1], fx.Node)
    return n.target in _CASTS or n.target in _UNARY or scalar


def _rebuild(
    gm: fx.GraphModule, terms: list, q: fx.Node, k: fx.Node, product: fx.Node
) -> dict[fx.Node, fx.Node] | str:
    """Each term of a score function rebuilt from q's and k's sizes (``local_mask``) and put in
    its place; or why one cannot be (the model's own terms back in)."""
    rebuilt: dict[fx.Node, fx.Node] = {}
    for user, t in terms:
        if t not in rebuilt:
            local = local_mask(gm, t, q, k, before=product)
            if isinstance(local, str):
                _restore(gm, rebuilt, terms)
                return local
            rebuilt[t] = local
        user.replace_input_with(t, rebuilt[t])
    return rebuilt


def _restore(gm: fx.GraphModule, rebuilt: dict[fx.Node, fx.Node], terms: list) -> None:
    """Undo ``_score_function``'s rebuilt terms: the model's own back in, the copies gone."""
    for user, t in terms:
        if t in rebuilt:
            user.replace_input_with(rebuilt[t], t)
    for m in rebuilt.values():
        discard(gm, m)


def _between(sm: fx.Node, pv: fx.Node) -> list[fx.Node]:
    """The nodes from a softmax to the product with v (casts, dropout, the sink's slice)."""
    out, n = [], only_user(sm)
    while n is not None and n is not pv:
        out.append(n)
        n = only_user(n)
    return out


def _sym(g: fx.Graph, x: fx.Node, dim: int) -> fx.Node:
    return sym_size(g, x, dim)


def _chain(gm: fx.GraphModule, x: fx.Node) -> tuple[fx.Node | None, str | None]:
    """Walk from a softmax's input down to the scores: (the scaled product, None), or
    (None, why the chain is not additive) — (None, None) when no product is found."""
    n, terms = x, 0
    for _ in range(32):
        if _is_product(n) and terms:
            return n, None
        if n.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(n.args[1], (int, float)):
            if _is_product(_below(node_arg(n, 0))):
                return (n, None) if terms else (None, None)  # no mask: not an attention here
            return None, f"{n.name} scales the scores after a term was added (soft-capping?)"
        if n.target in _CASTS or n.target in _VIEWS:
            n = node_arg(n, 0)
            continue
        paths = [a for a in n.all_input_nodes if _reaches_product(a)]
        if len(paths) != 1:
            return None, None if not paths else f"{n.name} combines two score paths"
        if not _adds_a_term(gm, n, paths[0]):
            return None, f"{n.name} ({_name(n)}) modifies the scores other than by adding a mask"
        n, terms = paths[0], terms + 1
    return None, None


def _over_keys(gm: fx.GraphModule, x: fx.Node) -> bool:
    """``x`` is [..., s, keys]: one row per query, its last dim sized by the sequence (s, or
    s + 1 with a sink column); a softmax over anything else (a router's experts) is no
    attention."""
    val = x.meta["val"]
    if val.dim() < 3:
        return False
    rows, keys = to_sympy(val.shape[-2], gm), to_sympy(val.shape[-1], gm)
    return rows == S and S in keys.free_symbols


def _below(n: fx.Node) -> fx.Node:
    """``n`` with the casts and views on it looked through."""
    while n.target in _CASTS or n.target in _VIEWS:
        n = node_arg(n, 0)
    return n


def _adds_a_term(gm: fx.GraphModule, n: fx.Node, path: fx.Node) -> bool:
    """``n`` adds a term to the scores ``path``, fills it at ≤ ``MASKED`` or clamps it there."""
    t, args = n.target, n.args
    if t == aten.add.Tensor:
        return bool(n.kwargs.get("alpha", 1) == 1)
    if t == aten.sub.Tensor:
        return args[0] is path and bool(n.kwargs.get("alpha", 1) == 1)
    if t == aten.masked_fill.Scalar:
        return args[0] is path and _low(args[2])
    if t == aten.where.ScalarOther:
        return args[1] is path and _low(args[2])
    if t == aten.where.self:  # GPT-Neo: where(mask, scores, tensor(finfo.min))
        return args[1] is path and _low_full(gm, args[2])
    if t in (aten.max.other, aten.maximum.default):
        return _low_full(gm, args[1] if args[0] is path else args[0])
    if t == aten.clamp_min.default:
        return args[0] is path and _low(args[1])
    return False


def _name(n: fx.Node) -> str:
    return str(getattr(n.target, "__name__", n.target))


def _low(v: object) -> bool:
    return isinstance(v, (int, float)) and float(v) <= MASKED


def _low_full(gm: fx.GraphModule, x: object) -> bool:
    """``x`` is a tensor filled with one value ≤ ``MASKED`` (``full``, or a constant)."""
    if not isinstance(x, fx.Node):
        return False
    while x.target in (*_CASTS, aten.clone.default, aten.lift_fresh_copy.default):
        x = node_arg(x, 0)
    if x.target == aten.full.default:
        return _low(x.args[1])
    ref = x.meta.get(META_INPUT)
    value = gm.meta.get(META_BUFFERS, {}).get(ref.name) if ref is not None else None
    return (
        ref is not None
        and ref.kind == "constant"
        and isinstance(value, torch.Tensor)
        and value.numel() == 1
        and _low(float(value))
    )


def _is_product(n: fx.Node) -> bool:
    if n.target not in _PRODUCTS or len(n.all_input_nodes) != 2:
        return False
    kt = node_arg(n, 1)
    return kt.target == aten.transpose.int and sorted(
        int_arg(kt, d) % kt.meta["val"].dim() for d in (1, 2)
    ) == [kt.meta["val"].dim() - 2, kt.meta["val"].dim() - 1]


def _reaches_product(x: fx.Node, depth: int = 24) -> bool:
    """Whether ``x`` is computed from a q·kᵀ product's values (a few elementwise steps up)."""
    return reaches(x, _is_product, depth, values_only=True)


def _probabilities(sm: fx.Node, sink_column: bool = False) -> tuple[fx.Node | None, fx.Node, float]:
    """From a softmax through casts, one dropout and views to the product with v:
    (that product, the probabilities it takes, dropout p), or (None, …) when there is none.
    With a ``sink_column``, the slice cutting it off (``[..., :-1]``) first."""
    probs, dropout = sm, 0.0
    user = only_user(probs)
    while user is not None and (user.target in _CASTS or user.target in _VIEWS):
        probs, user = user, only_user(user)
    if sink_column:
        if user is None or not cuts_last_column(user):
            return None, probs, dropout
        probs, user = user, only_user(user)
        while user is not None and (user.target in _CASTS or user.target in _VIEWS):
            probs, user = user, only_user(user)
    if user is not None and user.target == aten.dropout.default:
        probs, dropout = user, (float_arg(user, 1) if user.args[2] else 0.0)
        user = only_user(probs)
    while user is not None and (user.target in _CASTS or user.target in _VIEWS):
        probs, user = user, only_user(user)
    if user is None or user.target not in _PRODUCTS or user.args[0] is not probs:
        return None, probs, dropout
    return user, probs, dropout


def _unfold(gm: fx.GraphModule, xs: tuple, made: list[fx.Node]) -> tuple | None:
    """[h·b, s, d] tensors as [b, h, s, d] (h from their sizes; one that is [b, h, s, d]
    already is itself), or None."""
    g = gm.graph
    out = []
    shape: list[Any]
    for x in xs:
        if x.meta["val"].dim() == 4:
            out.append(x)
            continue
        expr = to_sympy(x.meta["val"].shape[0], gm)
        h = sympy.Poly(expr, B).coeff_monomial(B) if expr.free_symbols == {B} else 0
        if not h or sympy.expand(expr - h * B) != 0:
            return None
        v = x.meta["val"]
        want = v.reshape(v.shape[0] // int(h), int(h), v.shape[1], v.shape[2])
        src = x.args[0] if x.target in _VIEWS and x.target != aten.clone.default else None
        if isinstance(src, fx.Node) and _same_shape_as(src, want):  # folded from [b, h, s, d]
            out.append(src)
            continue
        first = _sym(g, x, 0)
        b = g.call_function(operator.floordiv, (first, int(h)))
        shape = [b, int(h), _sym(g, x, 1), int(x.meta["val"].shape[-1])]
        r = g.call_function(aten.reshape.default, (x, shape))
        r.meta["val"] = want
        made += [first, b, shape[2], r]
        out.append(r)
    return tuple(out)


def _zeros_like(gm: fx.GraphModule, x: fx.Node, q: fx.Node, k: fx.Node, before: fx.Node) -> fx.Node:
    """Zeros of ``x``'s shape and dtype, sized from q's and k's sizes (not from ``x``), marked
    as a rebuilt mask's nodes (the key length "keys")."""
    g = gm.graph
    val = x.meta["val"]
    made: list[fx.Node] = []

    def call(target, *args, **kwargs) -> fx.Node:
        made.append(g.call_function(target, args, kwargs))
        made[-1].meta[META_MASK_FN] = True
        return made[-1]

    with g.inserting_before(before):
        sizes: list = []
        for d in val.shape:
            e = to_sympy(d, gm)
            if e == S:
                sizes.append(sym_size(g, k, -2, "keys"))
            elif e.free_symbols:
                a = int(sympy.Poly(e, B).coeff_monomial(B))
                b = sym_size(g, q, 0)
                sizes.append(call(operator.mul, b, a) if a != 1 else b)
            else:
                sizes.append(int(e))
        return call(aten.zeros.default, sizes, dtype=val.dtype, device=val.device)


def _qk(scores: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """``matmul(q, kᵀ)`` [· c | ÷ c] → (q, k, c) (c = 1 when unscaled), else None."""
    scale = 1.0
    if scores.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(
        scores.args[1], (int, float)
    ):
        c = float(scores.args[1])
        scores, scale = node_arg(scores, 0), (c if scores.target == aten.mul.Tensor else 1.0 / c)
    if scores.target != aten.matmul.default or node_arg(scores, 1).target != aten.transpose.int:
        return None
    q, kt = node_arg(scores, 0), node_arg(scores, 1)
    if sorted(int_arg(kt, d) % 4 for d in (1, 2)) != [2, 3]:
        return None
    return q, node_arg(kt, 0), scale


def _replace(
    gm: fx.GraphModule,
    old: fx.Node,
    q,
    k,
    v,
    dropout: float,
    scale: float | None,
    window: int | None = None,
) -> None:
    """SDPA(q, k, v) in q's dtype (v cast to it, the output cast back to ``old``'s), in place
    of ``old`` and the chain that fed it; with a sliding ``window``, its mask built from the
    sizes (``lower_right_mask``)."""
    g = gm.graph
    dtype, out_dtype = q.meta["val"].dtype, old.meta["val"].dtype
    with g.inserting_before(old):
        if v.meta["val"].dtype != dtype:
            v = g.call_function(aten._to_copy.default, (v,), {"dtype": dtype})
            v.meta.update({k_: x for k_, x in old.meta.items() if k_ != "val"})
        mask = None if window is None else lower_right_mask(g, q, k, window)
        new = g.call_function(
            SDPA, (q, k, v, mask, float(dropout), window is None), {"scale": scale} if scale else {}
        )
        new.meta.update(old.meta)
        new.meta[META_WINDOW] = window
        out = new
        if out_dtype != dtype:
            out = g.call_function(aten._to_copy.default, (new,), {"dtype": out_dtype})
            out.meta.update({k_: x for k_, x in old.meta.items() if k_ != "val"})
    new.meta[META_ATTENTION] = "causal"
    old.replace_all_uses_with(out)
    erase_unused(gm.graph, old)  # the replaced chain (dropout is impure to fx)


def lower_right_mask(g: fx.Graph, q: fx.Node, k: fx.Node, window: int | None = None) -> fx.Node:
    """Boolean [Lq, Lk] mask built from the sizes in the graph, True where key j ≤ (Lk − Lq) + i
    (lower-right causal: the queries are the last Lq of the Lk positions) and, with a sliding
    ``window``, j > (Lk − Lq) + i − window."""
    lq = g.call_function(aten.sym_size.int, (q, -2))
    lk = g.call_function(aten.sym_size.int, (k, -2))
    lp = g.call_function(operator.sub, (lk, lq))
    where = {"dtype": torch.int64, "device": q.meta["val"].device}
    rows = g.call_function(
        aten.unsqueeze.default, (g.call_function(aten.arange.start, (lp, lk), where), 1)
    )
    cols = g.call_function(
        aten.unsqueeze.default, (g.call_function(aten.arange.default, (lk,), where), 0)
    )
    keep = g.call_function(aten.le.Tensor, (cols, rows))
    if window is not None:
        first = g.call_function(aten.sub.Tensor, (rows, window))
        keep = g.call_function(
            aten.bitwise_and.Tensor, (keep, g.call_function(aten.gt.Tensor, (cols, first)))
        )
    return keep


def _key(kind: str, how: object, sig: tuple | None) -> tuple | None:
    """A proof's memo key (``Proofs.once``): what it proves, how it reads the construction,
    and the construction's signature (None: not kept)."""
    return None if sig is None else (kind, how, sig)


def _causal_window(
    gm: fx.GraphModule, proofs: Proofs, mask: fx.Node, keep_is_true: bool, additive: bool = False
) -> tuple[str | None, int | None]:
    """``_evaluate_mask``, once per mask construction and reading."""
    return proofs.once(
        _key("band", (keep_is_true, additive), signature(gm, mask)),
        lambda: _evaluate_mask(gm, mask, keep_is_true, additive, proofs.longest),
    )


def _evaluate_mask(
    gm: fx.GraphModule, mask: fx.Node, keep_is_true: bool, additive: bool, longest: int
) -> tuple[str | None, int | None]:
    """``(None, W)`` if ``mask`` evaluates to the causal mask limited to the last W keys
    (query i sees keys i − W < j ≤ i: a sliding window; W None: plain causal) at every size
    tried, up to ``longest`` tokens, else ``(the reason, None)``. An ``additive`` mask must be
    0 where kept and at most ``MASKED`` elsewhere."""
    sub, inputs = _cut(gm, mask)
    if sub is None:
        return f"not causal: its mask depends on {inputs}", None
    read = _values_read(mask)
    if read:  # a pad id's mask (ids != 0) looks causal on ids that happen to hold no pad
        return f"not causal: its mask depends on the values of {', '.join(read)}", None
    length = reads_length(mask)
    if length:  # causal at the lengths tried proves nothing of the others
        return f"not provably causal: {length}", None
    # a window (Mistral's sliding window of 4096 keys) shows only past its length: also try
    # just past every integer the mask's construction uses, and at the longest length proven
    # (a window, a block or a threshold no integer names shows there)
    keeps = {}
    for s in proof_lengths(list(sub.graph.nodes), longest, _SIZES):
        args = [_example(ph, s, gm, 2 if s <= _SIZES[-1] else 1) for ph in inputs]
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            return (  # a buffer of a model built on the meta device: it has no values
                "not provably causal: its mask is built from a buffer of a model on the meta "
                "device, which has no values to prove it by (build the model on a real device)",
                None,
            )
        try:
            got = sub(*args)
        except Exception as exc:  # noqa: BLE001 - a mask we cannot evaluate is not proven
            return (
                f"not provably causal: its mask does not evaluate at sequence {s} ({said(exc)})",
                None,
            )
        if additive and (got.dtype == torch.bool or bool(((got != 0) & (got > MASKED)).any())):
            return (
                f"not causal: its additive mask is not 0 or -inf (at most {MASKED:g}) at sequence {s}",
                None,
            )
        got = got if got.dtype == torch.bool else (got == 0) if keep_is_true else got.bool()
        keeps[s] = got if keep_is_true else ~got
        if keeps[s].shape[-2:] != (s, s):
            return f"not causal: its mask is not {s} × {s} at sequence {s}", None
    longest = max(keeps)
    last = int(keeps[longest].reshape(-1, longest, longest)[0, -1].sum())  # the last query's keys
    window = None if last >= longest else last
    for s, keep in keeps.items():
        if not bool((keep == band(s, window)).all()):
            what = "causal mask" if window is None else f"causal mask within {window} keys"
            return f"not causal: its mask differs from the {what} at sequence {s}", None
    return None, window


OPTIONAL_DATA = OPTIONAL  # the batch's optional tensors: attention_mask, position_ids


def batch_inputs(gm: fx.GraphModule, mask: fx.Node) -> tuple[str, ...]:
    """The optional batch tensors (``attention_mask``, ``position_ids``) a mask's construction
    reads: such a mask depends on the batch's values, so no evaluation on made-up data proves
    it causal (an attention mask of random ids is almost all ones, and looked causal)."""
    seen, stack, found = set(), [mask], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        ref = n.meta.get(META_INPUT) if n.op == "placeholder" else None
        if ref is not None and ref.kind == "data" and ref.name in OPTIONAL_DATA:
            found.add(ref.name)
        stack.extend(n.all_input_nodes)
    return tuple(name for name in OPTIONAL_DATA if name in found)


def document_mask(
    attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, s: int
) -> torch.Tensor:
    """[b, 1, s, s] boolean, the form Seq1F1B chunks: query i sees key j iff j ≤ i, key j is a
    real token (``attention_mask[j] = 1``) and i, j are in one document (``position_ids``
    restart a document wherever they do not step up by exactly 1, as Hugging Face's packed
    sequences; ``documents``)."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = (j <= i)[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask.bool()[:, None, None, :]
    if position_ids is not None:
        doc = documents(position_ids)
        keep = keep & (doc[:, None, :, None] == doc[:, None, None, :])
    return keep


def documents(position_ids: torch.Tensor) -> torch.Tensor:
    """The document index of every token: a new document starts wherever the position does not
    step up by exactly 1 from the token before (Hugging Face's ``find_packed_sequence_indices``)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def _data_examples(s: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Padding and packings of 6 rows of ``s`` tokens: none, left, right, and holes (at least
    one real token a row); one document, random documents restarting at 0, positions of
    left-padded generation (1s, then 0, 1, ...), and random positions."""
    rows = 6
    mask = torch.ones(rows, s, dtype=torch.int64)
    left, right = (int(x) for x in torch.randint(1, s, (2,), generator=g))
    mask[1, :left] = 0
    mask[2, right:] = 0
    mask[3] = torch.randint(0, 2, (s,), generator=g)
    mask[3, int(torch.randint(0, s, (), generator=g))] = 1
    mask[4, : s // 2] = 0
    pos = torch.arange(s).repeat(rows, 1)
    for r in (1, 4):
        cuts = sorted({int(x) for x in torch.randint(1, s, (3,), generator=g)})
        for c in cuts:
            pos[r, c:] -= pos[r, c].clone()
    pos[2, :left] = 1
    pos[2, left:] = torch.arange(s - left)
    pos[3] = torch.randint(0, s, (s,), generator=g)
    pos[5] = torch.arange(s).flip(0)
    return {"attention_mask": mask, "position_ids": pos}


def _data_proof(
    gm: fx.GraphModule, proofs: Proofs, mask: fx.Node, names: tuple[str, ...], keep_is_true: bool
) -> str | None:
    """None if ``mask``'s construction evaluates to ``document_mask`` of the batch tensors it
    reads (``names``) on every padding and packing of ``_data_examples``, at several lengths
    up to the longest proven, else why not (a sliding window, a bidirectional prefix, queries
    masked, ...). Once per construction."""
    read = _values_read(mask)
    data = [
        n
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and n.meta[META_INPUT].kind == "data"
        and n.meta[META_INPUT].name in read
    ]
    return proofs.once(
        _key("data", (keep_is_true, names), signature(gm, mask, *data)),
        lambda: _evaluate_data_mask(gm, mask, names, keep_is_true, proofs.longest),
    )


def _evaluate_data_mask(
    gm: fx.GraphModule, mask: fx.Node, names: tuple[str, ...], keep_is_true: bool, longest: int
) -> str | None:
    """``_data_proof``'s evaluation."""
    sub, inputs = _cut(gm, mask)
    read = [name for name in _values_read(mask) if name not in names]
    if sub is None or read:
        return f"not causal: its mask depends on {inputs if sub is None else ', '.join(read)}"
    g = torch.Generator().manual_seed(0)
    why = None
    for s in sorted({*_SIZES, 21, 34, longest}):
        for _ in range(3 if s <= 34 else 1):
            batch = _data_examples(s, g)
            args = []
            for ph in inputs:
                ref = ph.meta[META_INPUT]
                if ref.kind == "data" and ref.name in batch:
                    args.append(batch[ref.name])
                elif ref.kind == "data":
                    args.append(torch.randint(0, 50, (6, s), generator=g))
                else:
                    args.append(_example(ph, s, gm))
            try:
                got = sub(*args)
            except Exception as exc:  # noqa: BLE001 - a mask we cannot evaluate is not proven
                why = f"not provably document-causal: its mask does not evaluate at sequence {s} ({said(exc)})"
                break
            if got.dtype != torch.bool:
                bad = (got != 0) & (got > MASKED)
                if keep_is_true or bool(bad.any()):
                    why = f"not document-causal: its additive mask is not 0 or -inf at sequence {s}"
                    break
                got = got == 0
            elif not keep_is_true:
                got = ~got
            want = document_mask(
                batch["attention_mask"] if "attention_mask" in names else None,
                batch["position_ids"] if "position_ids" in names else None,
                s,
            )
            if got.shape[-2:] != (s, s) or not bool((got == want).all()):
                why = (
                    f"not document-causal: its mask differs from the causal mask of the batch's "
                    f"{' and '.join(names)} at sequence {s}"
                )
                break
        if why:
            break
    return why


def band(s: int, window: int | None) -> torch.Tensor:
    """[s, s] boolean: query i sees key j iff j ≤ i (and i − j < window, when given)."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    return (j <= i) & ((i - j < window) if window is not None else True)


def _values_read(out: fx.Node) -> list[str]:
    """The batch tensors and activations whose values (not only sizes) ``out`` is computed
    from: evaluated on random ones, such a mask proves nothing about the real ones (and only
    parameters, buffers and sizes make a sink column)."""
    seen, stack, read = set(), [out], []
    while stack:
        n = stack.pop()
        if n in seen or n.target == aten.sym_size.int:
            continue
        seen.add(n)
        ref = n.meta.get(META_INPUT) if n.op == "placeholder" else None
        if ref is not None and ref.kind in ("data", "act"):
            read.append(ref.name)
        stack.extend(n.all_input_nodes)
    return sorted(read)


def _cut(gm: fx.GraphModule, out: fx.Node):
    """The subgraph computing ``out`` from placeholders, as a runnable GraphModule."""
    need, stack = set(), [out]
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(n.all_input_nodes)
    placeholders = [n for n in gm.graph.nodes if n in need and n.op == "placeholder"]
    params = [p for p in placeholders if p.meta[META_INPUT].kind == "param"]
    if params:
        return None, ", ".join(p.meta[META_INPUT].name for p in params)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n in need:
            env[n] = g.node_copy(n, lambda a: env[a])
            if "device" in n.kwargs:  # evaluated on the CPU: a mask's values name no device, and
                # a model on meta (no memory) builds its mask there, where no value can be read
                env[n].kwargs = {**n.kwargs, "device": torch.device("cpu")}
    g.output(env[out])
    return fx.GraphModule(gm, g), placeholders


def _example(ph: fx.Node, s: int, gm: fx.GraphModule, batch: int = 2) -> torch.Tensor:
    ref = ph.meta[META_INPUT]
    if ref.kind == "data":  # (its own generator: compiling draws nothing from torch's)
        return torch.randint(0, 50, (batch, s), generator=torch.Generator().manual_seed(s))
    if ref.kind in ("buffer", "constant"):
        return gm.meta[META_BUFFERS][ref.name]
    if ref.kind == "rank":
        return torch.tensor(0)
    return torch.tensor(0)
