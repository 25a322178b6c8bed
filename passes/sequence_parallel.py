"""sequence_parallel: after this pass, outside the tensor-parallel regions every activation
is split along the sequence over the tp ranks (Megatron's sequence parallelism).

Invariant (``plan.sequence_parallel`` and tp > 1): every ``tp_reduce`` (g) left by the
vocab_parallel and tensor_parallel passes is a ``tp_scatter_reduce`` along the sequence dim
(reduce-scatter), and every ``tp_copy`` (f) is a ``tp_gather`` along it (all-gather); between
them — norms, residual adds, dropout, biases — each rank holds b × s/tp × h. A replicated value
that spans the sequence (learned position embeddings) is cut to this rank's rows with
``index_select``. Every replicated parameter whose gradient now comes from this rank's rows only
(norm weights, row biases, position tables, the weights of a linear that tensor parallelism left
replicated) passes ``tp_all_reduce_grad`` (identity forward, all-reduce of its gradient over
tp). The sequence length must be divisible by tp (checked at
run time). A model whose split activations reach an op the rules do not cover is refused.

A vocabulary tp does not divide leaves the token embedding and the LM head whole (``META_ROLE``
"whole", vocab_parallel): the split then starts with ``tp_split`` after the embedding (this
rank's rows; all-gather backward, so every rank has the whole table's gradient) and ends with
``tp_join`` before the head (all-gather; this rank's rows of the gradient backward, which every
rank computes alike), so the head, the logits and the loss stay whole as without SP.
"""

from __future__ import annotations

import torch
from torch import fx

from autopart import collectives  # noqa: F401 - registers the autopart:: ops
from autopart.errors import AutopartError
from autopart.frontend.capture import S, to_sympy
from autopart.frontend.shapes import propagate
from autopart.layout import Plan
from autopart.meta import META_INPUT, META_MODULE, META_ROLE, META_SEQ, META_SHARD
from autopart.node_args import int_arg, node_arg, seq_arg
from autopart.passes.tensor_parallel import VIEWS, rank_input
from autopart.passes.tp_rules import Illegal, out_dim, tensor_of, tensor_val, view_map

aten, ops = torch.ops.aten, torch.ops.autopart


def sequence_parallel(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.sequence_parallel or plan.mesh.tp == 1:
        return gm
    rank = next(
        (n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[META_INPUT].kind == "rank"),
        None,
    )
    roles = {n.meta.get(META_ROLE) for n in gm.graph.nodes if n.target == aten.embedding.default}
    if not roles & {"vocab", "whole"}:  # (BLOOM's heads read tp_rank: a rank is not enough)
        raise AutopartError(
            "sequence parallelism starts at the token embedding (an embedding of input_ids "
            "with one row per vocabulary entry), and this model has none autopart recognizes",
            hint="run without sequence_parallel",
        )
    if rank is None:
        rank = rank_input(gm)  # (a whole vocabulary adds none; _my_rows may need it)
    seq: dict[fx.Node, int] = {}
    grad_reduce: set[fx.Node] = set()
    for n in list(gm.graph.nodes):
        if n.target == aten.embedding.default and n.meta.get(META_ROLE) == "whole":
            seq[_insert_after(gm, n, ops.tp_split.default, plan.mesh.tp)] = _seq_dim(n)
        elif n.meta.get(META_ROLE) == "whole" and any(a in seq for a in n.all_input_nodes):
            for a in [a for a in n.all_input_nodes if a in seq]:  # the head stays whole
                with gm.graph.inserting_before(n):
                    join = gm.graph.call_function(
                        ops.tp_join.default, (a, seq[a], "tp", plan.mesh.tp)
                    )
                join.meta.update({k: v for k, v in a.meta.items() if k != META_INPUT})
                n.replace_input_with(a, join)
        elif n.target == ops.tp_reduce.default:
            seq[_swap(gm, n, ops.tp_scatter_reduce.default, plan.mesh.tp)] = _seq_dim(n.args[0])
        elif n.target == ops.tp_copy.default:
            if n.args[0] not in seq:
                raise AutopartError(
                    f"{_named(n)} gathers a value that is not split along the sequence"
                )
            _swap(gm, n, ops.tp_gather.default, plan.mesh.tp, seq[n.args[0]])
        elif any(a in seq for a in n.all_input_nodes) and n.op == "call_function":
            _follow(gm, n, seq, rank, grad_reduce)
        elif n.op == "output" and any(a in seq for a in n.all_input_nodes):
            raise AutopartError("a sequence-split value reaches the graph output")
    for n in seq:
        n.meta[META_SEQ] = seq[n]
    weights_only: dict[fx.Node, bool] = {}
    for p in list(gm.graph.nodes):
        if not (
            p.op == "placeholder"
            and p.meta[META_INPUT].kind == "param"
            and p.meta.get(META_SHARD) is None
        ):
            continue
        split, whole = _uses(p, seq, weights_only)
        if any(u in grad_reduce for u in p.users) or (split and not whole):
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
            if u in seq:
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


def _follow(
    gm: fx.GraphModule, n: fx.Node, seq: dict[fx.Node, int], rank: fx.Node, grad_reduce: set
) -> None:
    """Carry the sequence split through ``n``, cutting replicated operands that span it."""
    if n.target in (aten.sym_size.int, aten._assert_tensor_metadata.default):
        if (
            n.target == aten.sym_size.int
            and int_arg(n, 1) % tensor_of(n.args[0]).dim() == seq[node_arg(n, 0)]
        ):
            raise AutopartError(f"{_named(n)} reads the sequence length of a sequence-split value")
        return
    rows = _row_wise(n, seq)
    if rows is not None:
        seq[n] = rows
        return
    try:
        seq[n] = out_dim(n, seq)
        if n.target in (*VIEWS, aten.expand.default):
            _local_length(gm, n, seq)
        return
    except Illegal as exc:
        reason = str(exc)
    if "spans the split dim" not in reason:
        raise AutopartError(
            f"sequence parallelism cannot pass {_named(n)}: {reason}",
            hint="run without sequence_parallel for this model",
        )
    split = next(a for a in n.all_input_nodes if a in seq)
    d = seq[split]
    for a in list(n.all_input_nodes):
        if a in seq or tensor_val(a) is None:
            continue
        pos = d - (tensor_of(n).dim() - tensor_of(a).dim())
        if pos >= 0 and tensor_of(a).shape[pos] != 1:
            n.replace_input_with(a, _my_rows(gm, n, a, pos, split, d, rank))
            grad_reduce.update(_params_above(a))
    seq[n] = out_dim(n, seq)


def _row_wise(n: fx.Node, seq: dict[fx.Node, int]) -> int | None:
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
    memo: dict[fx.Node, bool] = {}
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


def _my_rows(gm, n, a, pos, split, d, rank) -> fx.Node:
    """``a`` (replicated, full sequence at dim ``pos``) → its rows of this rank's chunk."""
    g = gm.graph
    with g.inserting_before(n):
        size = g.call_function(aten.sym_size.int, (split, d))  # s / tp
        first = g.call_function(aten.mul.Tensor, (rank, size))
        rows = g.call_function(aten.arange.default, (size,), {"device": tensor_of(a).device})
        index = g.call_function(aten.add.Tensor, (rows, first))
        mine = g.call_function(aten.index_select.default, (a, pos, index))
    for new in (size, first, rows, index, mine):
        new.meta.update({k: v for k, v in n.meta.items() if k != "val"})
    return mine


def _params_above(a: fx.Node) -> set[fx.Node]:
    """Parameter placeholders feeding ``a`` (its gradient is now a per-rank partial)."""
    out: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    stack = [a]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        ref = x.meta.get(META_INPUT)
        if ref is not None and ref.kind == "param":
            out.update(x.users)
        stack.extend(x.all_input_nodes)
    return out


def _reduce_grad(gm: fx.GraphModule, p: fx.Node) -> None:
    with gm.graph.inserting_after(p):
        new = gm.graph.call_function(ops.tp_all_reduce_grad.default, (p, "tp"))
    new.meta.update({k: v for k, v in p.meta.items() if k != META_INPUT})
    # uses the tensor_parallel pass already reduces (per-head norm weights) stay as they are
    p.replace_all_uses_with(
        new, delete_user_cb=lambda u: u is not new and u.target != ops.tp_all_reduce_grad.default
    )
