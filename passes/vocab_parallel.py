"""vocab_parallel: after this pass the vocabulary is split over tp ranks, never gathered.

Invariant (tp > 1): the token embedding (an ``embedding`` of the ``input_ids`` input whose
table has one row per vocabulary entry) and the LM head (the matmul whose output reaches the
loss) keep only this rank's contiguous block of V/tp vocabulary rows (``TPShard(0)``; a tied
embedding/LM head stays one parameter with one shard). The embedding looks up only the ids it
owns (others give zeros) followed by one ``tp_reduce``; the head's input passes one
``tp_copy``; the loss is ``autopart::vocab_parallel_ce`` over the local logits, so only
[b·s]-sized tensors cross ranks. The graph gets one more input, ``tp_rank`` (``InputRef("rank",
"tp")``), so every tp rank runs the same graph. A vocabulary tp does not divide (GPT-2's
50257, a test config's 97) stays whole: the embedding, the head and the plain cross entropy
run on every tp rank alike, as replicated regions do (exact; the head and the token embedding
marked ``whole``, so that ``tensor_parallel`` leaves them and ``sequence_parallel`` finds
them), with a warning to pad it.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from autopart.errors import AutopartError
from autopart.frontend.capture import InputRef
from autopart.frontend.shapes import propagate
from autopart.layout import Plan
from autopart.meta import (
    META_INPUT,
    META_ROLE,
    META_SHARD,
    META_VOCAB_DIMS,
)
from autopart.node_args import node_arg
from autopart.passes.tensor_parallel import (
    TPShard,
    _rewrite_constants,
    _set_shard,
    localize,
    rank_input,
    sum_partial_grads,
    tp_copy_of,
)
from autopart.passes.tp_rules import matmul_form, spread, tensor_of

aten, ops = torch.ops.aten, torch.ops.autopart
log = logging.getLogger("autopart")


def vocab_parallel(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    tp = plan.mesh.tp
    if tp == 1:
        return gm
    ce = _loss(gm)
    vocab = tensor_of(ce.args[0]).shape[-1]
    if vocab % tp:
        head = _head(gm, ce)
        if head is not None:  # whole: tensor_parallel leaves it alone, and says nothing of it
            head.meta.pop(META_VOCAB_DIMS, None)
            head.meta[META_ROLE] = "whole"
        for n in gm.graph.nodes:  # where sequence_parallel splits the sequence instead
            if _is_token_embedding(n, vocab):
                n.meta[META_ROLE] = "whole"
        log.warning(
            "vocab_parallel: the vocabulary (%d) is not divisible by tp=%d: the token embedding "
            "and the LM head stay whole on every tp rank, each computing every logit; pad the "
            "vocabulary to a multiple of %d to split them (nanoGPT pads 50257 to 50304)",
            vocab,
            tp,
            tp,
        )
        return gm
    rank = rank_input(gm)
    head = _head(gm, ce)
    if head is not None:
        _split_head(gm, head, ce, rank, tp)
    for n in list(gm.graph.nodes):
        if _is_token_embedding(n, vocab) or _reads_split_table(n, vocab):
            # a tied table split here and by the head: one TPShard(0)
            _split_embedding(gm, n, rank, vocab // tp)
    localize(gm, tp)
    return propagate(gm)


def _loss(gm: fx.GraphModule) -> fx.Node:
    ces = [n for n in gm.graph.nodes if n.target == aten.cross_entropy_loss.default]
    if len(ces) != 1:
        raise AutopartError(
            f"expected one cross-entropy loss in the captured graph, found {len(ces)}"
        )
    ce = ces[0]
    weight, reduction, ignore, smoothing = (
        list(ce.args[2:]) + [None, 1, -100, 0.0][len(ce.args) - 2 :]
    )[:4]
    if weight is not None or reduction != 2 or ignore != -100 or smoothing:
        raise AutopartError(
            f"loss node {ce.format_node()} is not a plain summed cross entropy",
            hint="capture adds the loss as summed CE with ignore_index=-100, no class weights, no label smoothing; pass a graph from autopart.frontend.capture unchanged, or run without vocabulary parallelism",
        )
    return ce


def _head(gm: fx.GraphModule, ce: fx.Node) -> fx.Node | None:
    """The matmul whose output features are the logits (walking back from the loss)."""
    n = ce.args[0]
    while isinstance(n, fx.Node) and matmul_form(n) is None and n.op == "call_function" and n.args:
        n = n.args[0]
    if not isinstance(n, fx.Node) or matmul_form(n) is None:
        return None
    sp = spread(gm, lambda f: f.node is n, end=lambda m, dims: m is ce)
    if sp.problems or sp.rows or sp.ends != [ce]:
        return None
    n.meta[META_VOCAB_DIMS] = sp.dims
    return n


def _split_head(gm: fx.GraphModule, head: fx.Node, ce: fx.Node, rank: fx.Node, tp: int) -> None:
    form = matmul_form(head)
    assert form is not None  # _head found it
    _set_shard(form.weight, TPShard(form.col_dim))
    if form.bias is not None:
        _set_shard(form.bias, TPShard(0))
    head.meta[META_ROLE] = "vocab"
    tp_copy_of(gm, form.x, head)
    dims = head.meta.pop(META_VOCAB_DIMS)
    for n in list(dims):
        _rewrite_constants(n, dims, tp)
    # a replicated value with a gradient that meets the split logits (a scale computed from
    # the activations, say) gets from each rank only its vocabulary slice's part of it
    # (a probe's aux-loss-scaled logits: a router's gradient 59 % off at tp=2, silently)
    sum_partial_grads(gm, dims, {head})
    with gm.graph.inserting_after(ce):
        vp = gm.graph.call_function(
            ops.vocab_parallel_ce.default, (ce.args[0], ce.args[1], rank, "tp")
        )
    with gm.graph.inserting_after(vp):
        loss = gm.graph.call_function(operator.getitem, (vp, 0))
    for new in (vp, loss):
        new.meta.update({k: v for k, v in ce.meta.items() if k != "val"})
    ce.replace_all_uses_with(loss)
    gm.graph.erase_node(ce)


def _is_token_embedding(n: fx.Node, vocab: int) -> bool:
    if n.target != aten.embedding.default:
        return False
    table, ids = n.args[0], n.args[1]
    while isinstance(ids, fx.Node) and ids.target in _SAME_IDS:  # input_ids.view(-1, s) etc.
        ids = ids.args[0]
    ref = ids.meta.get(META_INPUT) if isinstance(ids, fx.Node) else None
    return ref == InputRef("data", "input_ids") and tensor_of(table).shape[0] == vocab


def _reads_split_table(n: fx.Node, vocab: int) -> bool:
    """An embedding lookup into a table the head split by vocabulary rows (a tied table read
    with ids that are not ``input_ids`` as such: XLM's ``input_ids[:, -s:]``): the split lookup
    is exact for any ids, so it is split too rather than refused for reading the table whole."""
    if n.target != aten.embedding.default or not isinstance(n.args[0], fx.Node):
        return False
    shard = n.args[0].meta.get(META_SHARD)
    return isinstance(shard, TPShard) and shard.dim == 0 and tensor_of(n.args[0]).shape[0] == vocab


_SAME_IDS = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.clone.default,
        aten.contiguous.default,
        aten.to.dtype,
        aten._to_copy.default,
    }
)


def _split_embedding(gm: fx.GraphModule, n: fx.Node, rank: fx.Node, rows: int) -> None:
    """embedding(W, ids) → tp_reduce(zero-where-not-ours(embedding(W_local, ids − start)))."""
    table, ids = node_arg(n, 0), n.args[1]
    _set_shard(table, TPShard(0))
    g = gm.graph
    with g.inserting_before(n):
        start = g.call_function(aten.mul.Tensor, (rank, rows))
        local = g.call_function(aten.sub.Tensor, (ids, start))
        below = g.call_function(aten.lt.Scalar, (local, 0))
        above = g.call_function(aten.ge.Scalar, (local, rows))
        other = g.call_function(aten.logical_or.default, (below, above))  # ids another rank owns
        safe = g.call_function(aten.masked_fill.Scalar, (local, other, 0))
        looked = g.call_function(aten.embedding.default, (table, safe))
        mask = g.call_function(aten.unsqueeze.default, (other, -1))
        zeroed = g.call_function(aten.masked_fill.Scalar, (looked, mask, 0.0))
        new = [start, local, below, above, other, safe, looked, mask, zeroed]
        pad = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx", -1)
        if (
            isinstance(pad, int) and pad >= 0
        ):  # the padding row gets no gradient, as in nn.Embedding
            is_pad = g.call_function(aten.eq.Scalar, (ids, pad))
            pad_mask = g.call_function(aten.unsqueeze.default, (is_pad, -1))
            frozen = g.call_function(aten.detach.default, (zeroed,))
            zeroed = g.call_function(aten.where.self, (pad_mask, frozen, zeroed))
            new += [is_pad, pad_mask, frozen, zeroed]
        out = g.call_function(ops.tp_reduce.default, (zeroed, "tp"))
    for m in (*new, out):
        m.meta.update({k: v for k, v in n.meta.items() if k != "val"})
    looked.meta[META_ROLE] = "vocab"
    n.replace_all_uses_with(out)
    g.erase_node(n)
