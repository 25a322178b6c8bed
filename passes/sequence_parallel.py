"""sequence_parallel: after this pass, outside the tensor-parallel regions every activation
is split along the sequence over the tp ranks (Megatron's sequence parallelism), except where
no rule carries the split through an op: such an op runs on the whole sequence.

Invariant (``plan.sequence_parallel`` and tp > 1): every value is either split along the
sequence (b × s/tp × h on each rank) or whole, and a whole value — and its gradient — is the
same on every tp rank:

- every ``tp_reduce`` (g) left by the vocab_parallel and tensor_parallel passes is a
  ``tp_scatter_reduce`` along the sequence dim (reduce-scatter), and every ``tp_copy`` (f) of a
  split value a ``tp_gather`` along it (all-gather); between them — norms, residual adds,
  dropout, biases, linears tensor parallelism left replicated (row by row) — values are split;
- a whole operand that spans the sequence and meets a split value (learned positions, the
  output of a whole region) is cut by ``tp_split`` (this rank's rows; all-gather backward); an
  op no rule covers reads its split inputs through ``tp_join`` (all-gather; backward, this
  rank's rows of a gradient every rank computes alike) and runs whole, with one warning naming
  the first such op; a whole value that does not span the sequence and carries a gradient
  passes ``tp_all_reduce_grad`` where a split op reads it;
- every replicated parameter whose gradient now comes from this rank's rows only (norm
  weights, row biases, the weights of a linear left replicated) passes ``tp_all_reduce_grad``
  (identity forward, all-reduce of its gradient over tp).

A vocabulary tp does not divide leaves the token embedding and the LM head whole (``META_ROLE``
"whole", vocab_parallel): the split then starts with ``tp_split`` after the embedding and ends
with ``tp_join`` before the head, so the head, the logits and the loss stay whole as without SP.
The sequence length must be divisible by tp (checked at run time). Refused: a model with no
token embedding, a split value reaching the output.

Lengths: a size read from a split value along its split is the whole sequence's, the length
every tp rank reads without SP — the token ids' (``_whole_length``), or, for a rebuilt mask's
key length, the joined keys' (which Seq1F1B's chunk pass lengthens by the K/V prefix); a
slice keeping the whole sequence (``x[:, :s]``) of a split value is that value. One value is
joined once (``_joined``); a general-form attention joins k before its transpose.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from autopart import collectives  # noqa: F401 - registers the autopart:: ops
from autopart.errors import AutopartError
from autopart.frontend.capture import S, to_sympy
from autopart.frontend.shapes import propagate
from autopart.layout import Plan
from autopart.meta import (
    META_INPUT,
    META_MASK_FN,
    META_MODULE,
    META_ROLE,
    META_SCORES,
    META_SEQ,
    META_SHARD,
)
from autopart.node_args import int_arg, node_arg, seq_arg, whole_slice
from autopart.passes.tensor_parallel import VIEWS
from autopart.passes.tp_rules import Illegal, out_dim, tensor_of, tensor_val, view_map

aten, ops = torch.ops.aten, torch.ops.autopart
log = logging.getLogger("autopart")
_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})


def sequence_parallel(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.sequence_parallel or plan.mesh.tp == 1:
        return gm
    roles = {n.meta.get(META_ROLE) for n in gm.graph.nodes if n.target == aten.embedding.default}
    if not roles & {"vocab", "whole"}:
        raise AutopartError(
            "sequence parallelism starts at the token embedding (an embedding of input_ids "
            "with one row per vocabulary entry), and this model has none autopart recognizes",
            hint="run without sequence_parallel",
        )
    seq: dict[fx.Node, int] = {}
    memo: dict[fx.Node, bool] = {}  # _weights_only's
    joined: list[tuple[fx.Node, str]] = []  # nodes that run on the whole sequence, and why
    for n in list(gm.graph.nodes):
        if n.target == aten.embedding.default and n.meta.get(META_ROLE) == "whole":
            seq[_insert_after(gm, n, ops.tp_split.default, plan.mesh.tp)] = _seq_dim(n)
        elif n.meta.get(META_ROLE) == "whole" and any(a in seq for a in n.all_input_nodes):
            _join(gm, n, seq, plan.mesh.tp)  # the head stays whole
        elif n.target == ops.tp_reduce.default:
            if _seq_dims(n.args[0]) == 1:
                seq[_swap(gm, n, ops.tp_scatter_reduce.default, plan.mesh.tp)] = _seq_dim(
                    n.args[0]
                )  # (else its output stays whole: an all-reduce, as without SP)
        elif n.target == ops.tp_copy.default:
            if n.args[0] in seq:  # (a whole input keeps f: its gradient is every rank's alike)
                _swap(gm, n, ops.tp_gather.default, plan.mesh.tp, seq[n.args[0]])
        elif any(a in seq for a in n.all_input_nodes) and n.op == "call_function":
            _follow(gm, n, seq, memo, plan.mesh.tp, joined)
        elif n.op == "output" and any(a in seq for a in n.all_input_nodes):
            raise AutopartError("a sequence-split value reaches the graph output")
    if joined:
        n, why = joined[0]
        log.warning(
            "sequence_parallel: %d node(s) run on the whole sequence on every tp rank, between "
            "an all-gather and this rank's rows (no rule splits them), the first %s: %s",
            len(joined),
            _named(n),
            why,
        )
    for n in seq:
        n.meta[META_SEQ] = seq[n]
    for p in list(gm.graph.nodes):
        if not (
            p.op == "placeholder"
            and p.meta[META_INPUT].kind == "param"
            and p.meta.get(META_SHARD) is None
        ):
            continue
        split, whole = _uses(p, seq, memo)
        if split and not whole:
            _reduce_grad(gm, p)
        elif split:  # read whole elsewhere too: only the split reads' gradient is a partial
            for a in dict.fromkeys(a for _, a in split):
                _reduce_use(gm, a, seq)
    return propagate(gm)


def _weights_only(x: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Is ``x`` a function of parameters, buffers and constants only (no activation)?"""
    if x not in memo:
        if x.op == "placeholder":
            memo[x] = x.meta[META_INPUT].kind in ("param", "buffer", "constant")
        else:
            memo[x] = x.op in ("get_attr", "call_function") and all(
                _weights_only(a, memo) for a in x.all_input_nodes
            )
    return memo[x]


def _uses(
    p: fx.Node, seq: dict[fx.Node, int], memo: dict[fx.Node, bool]
) -> tuple[list[tuple[fx.Node, fx.Node]], list[fx.Node]]:
    """Where parameter ``p`` meets activations: through values computed from parameters alone
    (``1 + w`` of Gemma's norms, a cast), the split nodes that read it, as (node, the value it
    reads), and the nodes that read it with whole activations."""
    split, whole, seen, stack = [], [], set(), [p]
    while stack:
        v = stack.pop()
        for u in v.users:
            if u.target == ops.tp_all_reduce_grad.default:
                continue  # tensor_parallel reduces that use's gradient already
            if u.target == ops.tp_split.default:  # its gradient is whole: all-gathered
                whole.append(u)
            elif u in seq:
                split.append((u, v))
            elif u.op == "call_function" and _weights_only(u, memo):
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
            else:
                whole.append(u)
    return split, whole


def _reduce_use(gm: fx.GraphModule, a: fx.Node, seq: dict[fx.Node, int]) -> None:
    """Reduce over tp the gradient ``a`` gets from the split nodes that read it (not the one it
    gets from whole reads, which every tp rank computes alike)."""
    with gm.graph.inserting_after(a):
        new = gm.graph.call_function(ops.tp_all_reduce_grad.default, (a, "tp"))
    new.meta.update({k: v for k, v in a.meta.items() if k != META_INPUT})
    a.replace_all_uses_with(new, delete_user_cb=lambda u: u in seq)


def _seq_dims(n: fx.Node) -> int:
    """How many dims of ``n`` have the sequence's size."""
    val = tensor_val(n)
    return 0 if val is None else sum(to_sympy(d, _gm_of(n)) == S for d in val.shape)


def _seq_dim(n: fx.Node) -> int:
    val = tensor_of(n)
    dims = [i for i, d in enumerate(val.shape) if to_sympy(d, _gm_of(n)) == S]
    if len(dims) != 1:
        raise AutopartError(
            f"{_named(n)} has no single sequence dim (shape {tuple(val.shape)})",
            hint="sequence parallelism needs (batch, seq, hidden) activations at tp boundaries",
        )
    return dims[0]


def _named(n: fx.Node) -> str:
    """A node for a message: its name, module and op."""
    op = getattr(n.target, "__name__", str(n.target))
    return f"node {n.name} ({n.meta.get(META_MODULE) or '<root>'}, {op})"


def _gm_of(n: fx.Node) -> fx.GraphModule:
    gm = n.graph.owning_module
    assert gm is not None
    return gm


def _swap(gm: fx.GraphModule, n: fx.Node, op, tp: int, dim: int | None = None) -> fx.Node:
    x = node_arg(n, 0)
    dim = _seq_dim(x) if dim is None else dim
    with gm.graph.inserting_after(n):
        new = gm.graph.call_function(op, (x, dim, "tp", tp))
    new.meta.update(n.meta)
    n.replace_all_uses_with(new)
    gm.graph.erase_node(n)
    return new


def _insert_after(gm: fx.GraphModule, n: fx.Node, op, tp: int) -> fx.Node:
    """``op(n, seq dim, "tp", tp)`` in place of ``n`` for every reader of ``n``."""
    with gm.graph.inserting_after(n):
        new = gm.graph.call_function(op, (n, _seq_dim(n), "tp", tp))
    new.meta.update({k: v for k, v in n.meta.items() if k != META_ROLE})
    n.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
    return new


def _join(gm: fx.GraphModule, n: fx.Node, seq: dict[fx.Node, int], tp: int) -> None:
    """``n`` reads its sequence-split inputs whole: each through ``tp_join`` (all-gather), so
    ``n`` computes what every tp rank computes alike, and its gradient too (the join's
    backward keeps this rank's rows of it)."""
    kt = node_arg(n, 1) if n.meta.get(META_SCORES) == "qk" else None
    if kt is not None and kt.target == aten.transpose.int and node_arg(kt, 0) in seq:
        # q·kᵀ of a general-form attention: join k before its transpose, so that the chunk
        # pass (seq_rules.scored_qkv) still reads k as the transpose's input
        k = node_arg(kt, 0)
        join = _joined(gm, k, seq, tp, before=n)
        with gm.graph.inserting_before(n):
            new_kt = gm.graph.call_function(aten.transpose.int, (join, *kt.args[1:]))
        new_kt.meta.update({key: v for key, v in kt.meta.items() if key != META_INPUT})
        n.replace_input_with(kt, new_kt)
        if not kt.users:
            gm.graph.erase_node(kt)
    for a in dict.fromkeys(a for a in n.all_input_nodes if a in seq):
        n.replace_input_with(a, _joined(gm, a, seq, tp, before=n))


def _joined(
    gm: fx.GraphModule, a: fx.Node, seq: dict[fx.Node, int], tp: int, before: fx.Node | None
) -> fx.Node:
    """``tp_join`` of the split value ``a`` (all-gather along its split): the one already
    made, or a new one before ``before`` (None: right after ``a``). A rebuilt mask's key length
    reads the keys joined for their attention (``_follow``): the length the chunk pass
    lengthens by the K/V prefix's (``sequence_chunk._keys_from`` finds it by the keys)."""
    for u in a.users:
        if u.target == ops.tp_join.default and u.args[1] == seq[a]:
            return u
    where = gm.graph.inserting_after(a) if before is None else gm.graph.inserting_before(before)
    with where:
        join = gm.graph.call_function(ops.tp_join.default, (a, seq[a], "tp", tp))
    join.meta.update({k: v for k, v in a.meta.items() if k != META_INPUT})
    return join


def _follow(
    gm: fx.GraphModule,
    n: fx.Node,
    seq: dict[fx.Node, int],
    memo: dict[fx.Node, bool],
    tp: int,
    joined: list[tuple[fx.Node, str]],
) -> None:
    """Carry the sequence split through ``n``, cutting whole operands that span it
    (``tp_split``); an op no rule carries the split through runs whole (``_join``)."""
    if n.target in (aten.sym_size.int, aten._assert_tensor_metadata.default):
        if (
            n.target == aten.sym_size.int
            and int_arg(n, 1) % tensor_of(n.args[0]).dim() == seq[node_arg(n, 0)]
        ):
            if n.meta.get(META_MASK_FN) == "keys":  # a rebuilt mask's key length
                n.update_arg(0, _joined(gm, node_arg(n, 0), seq, tp, before=None))
            else:
                _whole_length(gm, n)
        return
    if n.target == aten.slice.Tensor and whole_slice(n):  # x[:, :s]: x, whose rows are not s
        n.replace_all_uses_with(node_arg(n, 0))
        gm.graph.erase_node(n)
        return
    rows = _row_wise(n, seq, memo)
    if rows is not None:
        seq[n] = rows
        return
    try:
        if n.target in _SPLITS and int_arg(n, 2, "dim", 0) % tensor_of(n.args[0]).dim() == seq.get(
            node_arg(n, 0)
        ):  # (tp_rules leaves a split along the split dim to tensor_parallel's strided shards)
            raise Illegal("splits the value along its sequence-split dim")
        seq[n] = out_dim(n, seq)
    except Illegal as exc:
        reason = str(exc)
        if "spans the split dim" in reason:
            _cut(gm, n, seq, tp)
            try:
                seq[n] = out_dim(n, seq)
            except Illegal as again:
                reason = str(again)
        if n not in seq:
            _join(gm, n, seq, tp)
            joined.append((n, reason))
            return
    if n.target in (*VIEWS, aten.expand.default):
        _local_length(gm, n, seq)
    for a in dict.fromkeys(n.all_input_nodes):  # whole, not spanning it, with a gradient
        if a not in seq and _grad_from_activations(a, memo):
            _reduce_use(gm, a, {n: 0})


def _cut(gm: fx.GraphModule, n: fx.Node, seq: dict[fx.Node, int], tp: int) -> None:
    """``n``'s whole operands that span its split sequence dim → ``tp_split`` of them."""
    d = seq[next(a for a in n.all_input_nodes if a in seq)]
    for a in list(dict.fromkeys(n.all_input_nodes)):
        if a in seq or tensor_val(a) is None:
            continue
        pos = d - (tensor_of(n).dim() - tensor_of(a).dim())
        if pos >= 0 and tensor_of(a).shape[pos] != 1:
            with gm.graph.inserting_before(n):
                cut = gm.graph.call_function(ops.tp_split.default, (a, pos, "tp", tp))
            cut.meta.update({k: v for k, v in a.meta.items() if k != META_INPUT})
            n.replace_input_with(a, cut)
            seq[cut] = pos


def _grad_from_activations(a: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Is ``a`` a floating value computed from activations (not from weights alone, whose
    reads ``_uses`` reduces), so that it carries a gradient back into the graph?"""
    val = tensor_val(a)
    if val is None or not val.is_floating_point() or _weights_only(a, memo):
        return False
    seen, stack = set(), [a]
    while stack:  # a parameter above it: the token embedding's, at least
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder" and x.meta[META_INPUT].kind == "param":
            return True
        stack.extend(x.all_input_nodes)
    return False


def _row_wise(n: fx.Node, seq: dict[fx.Node, int], memo: dict[fx.Node, bool]) -> int | None:
    """The split dim of a linear (or a matmul by a 2-D weight) that tensor parallelism left
    replicated, applied to a value split along the sequence: it works row by row, so its output
    keeps the split, and its weight's gradient, now from this rank's rows only, is all-reduced
    over tp like a norm's (``_uses``). None for anything else: a weight computed from
    activations (its gradient would be a partial sum too, and no rule reduces it), or a split
    along the contracted dim."""
    if n.target == aten.linear.default:
        x, weights = node_arg(n, 0), [a for a in n.args[1:] if isinstance(a, fx.Node)]
    elif n.target in (aten.matmul.default, aten.mm.default):
        x, weights = node_arg(n, 0), [node_arg(n, 1)]
        if tensor_of(weights[0]).dim() != 2:
            return None
    else:
        return None
    if x not in seq or not all(w not in seq and _weights_only(w, memo) for w in weights):
        return None
    d = seq[x] % tensor_of(x).dim()
    return None if d == tensor_of(x).dim() - 1 else d


def _local_length(gm: fx.GraphModule, n: fx.Node, seq: dict[fx.Node, int]) -> None:
    """A view/expand of a sequence-split value names the sequence length: make it the local one."""
    src = node_arg(n, 0)
    idx = view_map(n, seq[src])[1] if n.target in VIEWS else seq[n]
    shape = list(seq_arg(n, 1))
    if shape[idx] == -1:
        return
    with gm.graph.inserting_before(n):
        local = gm.graph.call_function(aten.sym_size.int, (src, seq[src]))
    local.meta.update({k: v for k, v in n.meta.items() if k != "val"})
    shape[idx] = local
    n.update_arg(1, shape)


def _whole_length(gm: fx.GraphModule, n: fx.Node) -> None:
    """``x.shape[d]`` of a value split along d reads the whole sequence's length (the token
    ids', which stay whole), the length every tp rank would read without SP: a view of a split
    value that names it is made local again by ``_local_length``, a whole op (a slice of a
    joined value, a range of positions) gets the length it had."""
    ids = next(
        node_arg(e, 1)
        for e in gm.graph.nodes
        if e.target == aten.embedding.default and e.meta.get(META_ROLE) in ("vocab", "whole")
    )
    d = _seq_dim(ids)
    whole = next(
        (u for u in ids.users if u.target == aten.sym_size.int and u.args[1:] == (d,)), None
    )  # export's own read of the length, or one made by an earlier call
    if whole is not None:
        ids.append(whole)  # right after the ids (it reads nothing else): before every reader
    else:
        with gm.graph.inserting_after(ids):
            whole = gm.graph.call_function(aten.sym_size.int, (ids, d))
        whole.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        whole.meta["val"] = n.meta.get("val")
    n.replace_all_uses_with(whole)
    gm.graph.erase_node(n)


def _reduce_grad(gm: fx.GraphModule, p: fx.Node) -> None:
    with gm.graph.inserting_after(p):
        new = gm.graph.call_function(ops.tp_all_reduce_grad.default, (p, "tp"))
    new.meta.update({k: v for k, v in p.meta.items() if k != META_INPUT})
    # uses the tensor_parallel pass already reduces (per-head norm weights) stay as they are
    p.replace_all_uses_with(
        new, delete_user_cb=lambda u: u is not new and u.target != ops.tp_all_reduce_grad.default
    )
