"""tensor_parallel: after this pass every matmul pair that can be split Megatron-style is.

Invariant: each *region* — column matmuls whose split output features reach one or more row
matmuls' input features only through ops that keep the split local (pointwise ops, per-head
attention, head reshapes, rotary slicing, GQA repeats) — runs on tp ranks with:

- column weights (and biases) split by output features, strided when the output is split into
  equal parts afterwards, or viewed as a count of groups tp does not divide followed by the
  heads (fused QKV as nanoGPT's ``split`` or timm's ``view(b, s, 3, heads, hd)``: each rank
  keeps its heads of q, k and v);
- one ``autopart::tp_copy`` (f) on each distinct input of the region's column matmuls;
- row weights split by input features; each row matmul followed by one ``autopart::tp_reduce``
  (g), its bias added after the reduction;
- every shape constant that encodes a split size divided by tp (``view``/``reshape``/
  ``expand`` sizes, ``split`` sizes); ``meta["val"]`` holds the local shapes;
- one ``autopart::tp_all_reduce_grad`` on each replicated operand that carries a gradient into
  a split op (a per-head norm weight, as Qwen3's q/k norms): that op sees only this rank's
  heads, so the gradient it sends back is this rank's share and the ranks' shares are summed;
- an attention split by heads whose mask was rebuilt from sizes and buffers and differs per
  head (ALiBi) reads this rank's heads of it (``index_select`` by ``tp_rank``);
- an attention with fewer key/value heads than tp (or a count tp does not divide) keeps its
  key/value projections whole on every rank and reads the heads its query heads share
  (``index_select`` by ``tp_rank`` of every replicated operand ``tp_rules.narrowed`` names: an
  SDPA's k and v, an eager attention's products' keys and values); every gradient entering
  that replicated chain is summed over tp, as Megatron does for replicated KV heads.

Parameter placeholders get ``meta["autopart.shard"]`` = ``TPShard(dim, strided)`` or keep
``None`` (replicated). A region the rules cannot prove is left replicated with a warning naming
the node that stopped it; it is never split unsafely. Matmuls already handled by the
vocab_parallel pass are left alone. No module or parameter names are used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from autopart import collectives  # noqa: F401 - registers the autopart:: ops
from autopart.errors import AutopartError
from autopart.frontend.capture import InputRef, from_parameters
from autopart.frontend.shapes import fake_like, fake_mode, propagate
from autopart.layout import Plan
from autopart.meta import (
    META_GLOBAL_VAL,
    META_INPUT,
    META_LAYER,
    META_MASK_FN,
    META_MODULE,
    META_ROLE,
    META_SHARD,
    META_TP_SPLIT,
)
from autopart.node_args import int_arg, node_arg, seq_arg
from autopart.passes.tp_rules import (
    Matmul,
    matmul_form,
    narrowed,
    per_head_mask,
    spread,
    tensor_of,
    tensor_val,
    view_groups,
    view_map,
)

log = logging.getLogger("autopart")
aten, ops = torch.ops.aten, torch.ops.autopart


@dataclass(frozen=True)
class TPShard:
    """A parameter split over the tp group along ``dim`` (``strided`` interleaved blocks)."""

    dim: int
    strided: int = 1


def tensor_parallel(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    tp = plan.mesh.tp
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta.setdefault(META_SHARD, None)
    if tp == 1:
        return gm
    excluded: set[fx.Node] = set()
    kv: set[fx.Node] = set()  # the key/value projections kept whole (fewer heads than tp)
    grouped: set[fx.Node] = set()  # views splitting each of their groups (strided shards)
    while True:
        sp = spread(gm, _columns_but(excluded | kv), grouped=grouped)
        more = _grouped_views(sp, tp) - grouped
        if more:
            grouped |= more
            continue
        strided = _strided(sp, grouped, tp)  # unproven strided cuts become problems
        bad = _invalid_regions(sp, tp, kv, strided)
        if not bad:
            cut = _kv_columns(sp, tp)
            if not cut:
                bad = _indivisible_regions(sp, tp)
                if not bad:
                    break
        for members, reason in bad:
            cols = [m for m in members if m in sp.columns]
            excluded.update(cols)
            log.warning(
                "tensor_parallel: leaving %s replicated: %s",
                ", ".join(f"{c.name} ({c.meta.get(META_MODULE)})" for c in cols),
                reason,
            )
        if bad:
            continue
        kv.update(cut)
        log.info(
            "tensor_parallel: keeping %s whole on every rank: fewer key/value heads than tp = %d",
            ", ".join(f"{c.name} ({c.meta.get(META_MODULE)})" for c in cut),
            tp,
        )
    _check_divisible(sp, tp)
    for n in sp.columns:
        form = matmul_form(n)
        assert form is not None  # spread's columns and rows are matmul forms
        _split_column(gm, form, strided.get(n, 1))
    for n in sp.rows:
        form = matmul_form(n)
        assert form is not None
        _split_row(gm, form)
    selects = _select_heads(gm, sp, tp)
    for n in list(sp.dims):
        _rewrite_constants(n, sp.dims, tp, n in grouped)
        n.meta[META_TP_SPLIT] = sp.dims[n]
    sum_partial_grads(gm, sp.dims, {*sp.columns, *selects})
    _mask_heads(gm, sp, tp)
    localize(gm, tp)
    return propagate(gm)


def _mask_heads(gm: fx.GraphModule, sp, tp: int) -> None:
    """An SDPA split by heads whose rebuilt mask differs per head (``tp_rules.per_head_mask``:
    ALiBi's slopes) reads this rank's heads of it: ``index_select`` of rows
    ``tp_rank · h/tp + arange(h/tp)`` along the mask's head dim (marked part of the mask
    function, so the chunk pass treats it like the mask it selects from)."""
    rank = None
    for n in list(gm.graph.nodes):
        if n.target != aten.scaled_dot_product_attention.default or n not in sp.dims:
            continue
        pos = per_head_mask(n)
        if pos is None:
            continue
        mask = node_arg(n, 3)
        heads = tensor_of(mask).shape[pos]
        if not isinstance(heads, int) or heads % tp:
            raise AutopartError(
                f"attention {n.name} ({n.meta.get(META_MODULE) or '<root>'}) has a mask of "
                f"{heads} heads, which tp = {tp} does not divide",
                hint="choose a tp that divides the number of attention heads",
            )
        rank = rank or _tp_rank(gm)
        g = gm.graph
        with g.inserting_before(n):
            made = _head_index(g, rank, heads, tp, tensor_of(mask).device)
            mine = g.call_function(aten.index_select.default, (mask, pos, made[-1]))
        for new in (*made, mine):
            new.meta.update({k: v for k, v in mask.meta.items() if k != "val"})
            new.meta[META_MASK_FN] = True
        n.replace_input_with(mask, mine)


def _columns_but(whole: set[fx.Node]) -> Callable[[Matmul], bool]:
    """Which matmuls ``spread`` may split: all but ``whole`` and the vocab pass's."""
    return lambda f: f.node not in whole and META_ROLE not in f.node.meta


def _head_index(
    g: fx.Graph, rank: fx.Node, heads: int, tp: int, device: torch.device
) -> list[fx.Node]:
    """The nodes computing this rank's rows of ``heads`` (the last is the index):
    ``rank · heads/tp + arange(heads/tp)`` when tp divides them, else the one row
    ``rank // (tp/heads)`` (tp a multiple of them: the head its query heads share)."""
    if heads % tp == 0:
        per, first = heads // tp, g.call_function(aten.mul.Tensor, (rank, heads // tp))
    else:
        per = 1
        first = g.call_function(
            aten.div.Scalar_mode, (rank, tp // heads), {"rounding_mode": "floor"}
        )
    rows = g.call_function(aten.arange.default, (per,), {"device": device})
    return [first, rows, g.call_function(aten.add.Tensor, (rows, first))]


def _tp_rank(gm: fx.GraphModule) -> fx.Node:
    """The graph's ``tp_rank`` input (``InputRef("rank", "tp")``), added if missing."""
    for n in gm.graph.nodes:
        ref = n.meta.get(META_INPUT) if n.op == "placeholder" else None
        if ref is not None and ref.kind == "rank" and ref.name == "tp":
            return n
    return rank_input(gm)


def rank_input(gm: fx.GraphModule) -> fx.Node:
    """A new ``tp_rank`` input (``InputRef(\"rank\", \"tp\")``), after the last placeholder."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        rank = gm.graph.placeholder("tp_rank")
    with fake_mode([last.meta["val"]]):
        rank.meta["val"] = torch.empty((), dtype=torch.int64)
    rank.meta.update(
        {
            META_INPUT: InputRef("rank", "tp"),
            META_MODULE: "",
            META_LAYER: None,
            META_SHARD: None,
        }
    )
    return rank


def _invalid_regions(
    sp, tp: int, kv: set[fx.Node], strided: dict[fx.Node, int]
) -> list[tuple[list[fx.Node], str]]:
    """The regions (with a column matmul) to leave replicated, each with the reason: a node no
    rule splits, no row matmul to end it, a replicated operand to cut (``tp_rules.narrowed``)
    that is not the keys or values of the projections ``kv`` kept whole, replicated keys and
    values whose heads tp cannot share out (``_kv_heads_unfit``), or a weight that matmuls
    would split two ways (one ``Linear`` applied twice, as a column and then a row, or as
    columns of different strides: it used to refuse the whole plan), or a weight or column
    bias that a node outside every splitting region reads whole."""
    bad = []
    roles: dict[fx.Node, dict[tuple[str, int, int], int]] = {}  # weight → its splits → a region
    biases: dict[fx.Node, set[int]] = {}  # a column's bias → the regions splitting it
    regions: dict[int, list[fx.Node]] = {}
    for key, members in enumerate(sp.components().values()):
        if not any(m in sp.columns for m in members):
            continue
        problems = [m for m in members if m in sp.problems]
        uneven = [m for m in members if _uneven_split(sp, m)]
        unfit = [
            (m, why)
            for m in members
            if m.target == _SDPA and narrowed(m, sp.dims) and (why := _kv_heads_unfit(m, tp))
        ]
        stray = [m for m in members for src, _ in narrowed(m, sp.dims) if not _from(src, kv)]
        if problems:
            p = problems[0]
            bad.append(
                (members, f"{p.name} ({p.meta.get(META_MODULE) or '<root>'}): {sp.problems[p]}")
            )
        elif stray:
            m = stray[0]
            bad.append(
                (
                    members,
                    f"{m.name} ({m.meta.get(META_MODULE) or '<root>'}): a replicated operand "
                    "spans the split heads (not keys or values kept whole)",
                )
            )
        elif unfit:
            m, why = unfit[0]
            bad.append((members, f"{m.name} ({m.meta.get(META_MODULE) or '<root>'}) has {why}"))
        elif not any(m in sp.rows for m in members):
            bad.append((members, "its split output never reaches a row matmul"))
        elif uneven:  # a fused projection of unequal parts (GQA's q | k | v)
            u = uneven[0]
            sizes = sorted({int(v.shape[sp.dims[node_arg(u, 0)]]) for v in u.meta["val"]})
            bad.append(
                (
                    members,
                    f"{u.name} ({u.meta.get(META_MODULE) or '<root>'}) cuts a fused projection "
                    f"into parts of unequal widths {sizes}, which a split by columns would mix",
                )
            )
        else:
            regions[key] = members
            for m in members:
                f = matmul_form(m) if m in sp.columns or m in sp.rows else None
                if f is not None:
                    split = (
                        ("column", f.col_dim, strided.get(m, 1))
                        if m in sp.columns
                        else ("row", f.row_dim, 1)
                    )
                    roles.setdefault(f.weight, {})[split] = key
                    if m in sp.columns and f.bias is not None:
                        biases.setdefault(f.bias, set()).add(key)
    for weight, splits in roles.items():
        if len(splits) > 1:
            name = weight.meta[META_INPUT].name
            ways = " and ".join(
                f"{role}{f' strided ×{k}' if k > 1 else ''}" for role, _, k in splits
            )
            why = f"the weight {name} would be split {len(splits)} ways ({ways} of matmuls)"
            for key in dict.fromkeys(splits.values()):
                if all(members is not regions[key] for members, _ in bad):
                    bad.append((regions[key], why))
    # a weight split for one region's matmul and read whole by a node outside every region
    # that splits (the same Linear applied again where tp cannot split it): the plan was refused
    # ("reads it whole", the twenty-sixth session's probe); the region stays replicated instead
    splitting = {m for key, members in regions.items() for m in members} - {
        m for members, _ in bad for m in members
    }
    shared = {w: set(splits.values()) for w, splits in roles.items()}
    for bias, keys in biases.items():
        shared.setdefault(bias, set()).update(keys)
    for param, keys in shared.items():
        whole = [u for u in param.users if u not in splitting or u not in (*sp.columns, *sp.rows)]
        if not whole:
            continue
        name = param.meta[META_INPUT].name
        u = whole[0]
        why = (
            f"the parameter {name} is read whole too, by {u.name} "
            f"({u.meta.get(META_MODULE) or '<root>'}), which tp does not split"
        )
        for key in sorted(keys):
            if all(members is not regions[key] for members, _ in bad):
                bad.append((regions[key], why))
    return bad


def _indivisible_regions(sp, tp: int) -> list[tuple[list[fx.Node], str]]:
    """The regions (with a column matmul) that would split a fixed size tp does not divide (an
    MLP width of 37, 6 heads at tp=4), each with the reason: left replicated, they are exact
    (this refused the whole plan). Asked last, once the key/value projections that fewer heads
    than tp keep whole are known (their head counts are not split)."""
    bad = []
    for members in sp.components().values():
        if not any(m in sp.columns for m in members):
            continue
        for m in members:
            val = tensor_val(m)
            if val is None or m not in sp.dims:
                continue
            size = val.shape[sp.dims[m]]
            if isinstance(size, int) and size % tp:
                shape = tuple(val.shape)
                bad.append(
                    (
                        members,
                        f"{m.name} ({m.meta.get(META_MODULE) or '<root>'}) would split dim "
                        f"{sp.dims[m]} of shape {shape}, and {size} is not divisible by tp={tp}",
                    )
                )
                break
    return bad


def _uneven_split(sp, n: fx.Node) -> bool:
    """``n`` cuts a split value along its split dim into parts of unequal sizes."""
    if n.target not in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return False
    src = node_arg(n, 0)
    if src not in sp.dims or int_arg(n, 2, "dim", 0) % tensor_of(src).dim() != sp.dims[src]:
        return False
    return len({tuple(v.shape)[sp.dims[src]] for v in n.meta["val"]}) > 1


def _check_divisible(sp, tp: int) -> None:
    for n, d in sp.dims.items():
        val = tensor_val(n)
        if val is None or not isinstance(val.shape[d], int):
            continue
        if val.shape[d] % tp:
            raise AutopartError(
                f"node {n.name} ({n.meta.get(META_MODULE) or '<root>'}) splits dim {d} of shape "
                f"{tuple(val.shape)} over tp={tp}, but {val.shape[d]} is not divisible by {tp}",
                hint="choose a tp that divides the hidden size, the MLP width and the number of "
                "attention heads (fewer key/value heads than tp are replicated when tp is a "
                "multiple of their count)",
            )


def _grouped_views(sp, tp: int) -> set[fx.Node]:
    """The views that would put the split on a count of groups tp does not divide (timm's
    ``qkv.view(b, s, 3, heads, hd)``: the 3 of q, k, v, which left the attention replicated)
    while each group's heads can be split: ``view_map(..., grouped=True)`` splits those."""
    return {
        n
        for n in sp.dims
        if n.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
        and node_arg(n, 0) in sp.dims
        and (g := view_groups(n, sp.dims[node_arg(n, 0)])) is not None
        and g % tp
    }


def _strided(sp, grouped: set[fx.Node], tp: int) -> dict[fx.Node, int]:
    """Column matmuls whose split output is cut into equal parts along the split dim, or viewed
    as groups each split (``grouped``): the count of parts, by which their weights are sharded
    strided. Such a layout is proven only when the column's output reaches the cut alone,
    through local ops that read no other split value and whose only reader is the next one:
    another reader (a row matmul reading q | k | v whole, a second column added before the
    cut, a second cut of another count) would see the strided features as contiguous ones (a
    silently wrong sum: the twenty-sixth session's probe). The path must not pass another cut
    (two cuts in a row need a stride of their product) nor change the split dim's size (a
    ``repeat_interleave`` before the cut), and each part must hold a whole share per rank. Each
    cut that is not proven is recorded in ``sp.problems``, so its region stays replicated."""
    out: dict[fx.Node, int] = {}
    for n in sp.dims:
        parts = _strided_parts(sp, n, grouped)
        if parts is None:
            continue
        x = node_arg(n, 0)
        src, why = _strided_source(sp, x, grouped)
        width = tensor_of(x).shape[sp.dims[x]]
        if src is not None and not why:
            if width != tensor_of(src).shape[sp.dims[src]]:
                why = f"{n.name} cuts a width other than its projection's"
            elif not isinstance(width, int) or width % (parts * tp):
                why = f"{n.name} cuts {width} features into {parts} parts that tp={tp} cannot share"
            elif out.get(src, parts) != parts:
                why = f"cut into {out[src]} and into {parts} strided parts"
        if src is None or why:
            sp.problems[n] = why or "a strided cut not proven"
            continue
        out[src] = parts
    return out


def _strided_parts(sp, n: fx.Node, grouped: set[fx.Node]) -> int | None:
    """The count of equal parts ``n`` cuts its split input's split dim into, else None."""
    if n in grouped:
        return int(tensor_of(n).shape[sp.dims[n] - 1])
    if n.target not in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return None
    src = node_arg(n, 0)
    if src not in sp.dims or int_arg(n, 2, "dim", 0) % tensor_of(src).dim() != sp.dims[src]:
        return None
    sizes = {tuple(v.shape)[sp.dims[src]] for v in n.meta["val"]}
    if len(sizes) != 1:
        return None  # unequal parts: ``_invalid_regions`` leaves the region replicated
    return len(n.meta["val"])


def _strided_source(sp, x: fx.Node, grouped: set[fx.Node]) -> tuple[fx.Node | None, str]:
    """The column matmul whose output alone reaches ``x`` (see ``_strided``), or None with why
    not."""
    while True:
        if _strided_parts(sp, x, grouped) is not None:
            return None, f"{x.name} cuts the split dim before another strided cut"
        readers = [u for u in x.users if u.target not in _SHAPE_ONLY]
        if len(readers) != 1:
            return None, f"{x.name} is read by {len(readers)} nodes before a strided cut"
        if x in sp.columns:
            return x, ""
        inputs = [a for a in x.all_input_nodes if a in sp.dims]
        if len(inputs) != 1:
            return None, f"{x.name} joins {len(inputs)} split values before a strided cut"
        x = inputs[0]


_SHAPE_ONLY = frozenset({aten.sym_size.int, aten._assert_tensor_metadata.default})


def _set_shard(p: fx.Node, shard: TPShard) -> None:
    old = p.meta.get(META_SHARD)
    if old is not None and old != shard:
        raise AutopartError(
            f"parameter {p.meta['autopart.input'].name} would be split two ways ({old} and {shard})",
            hint="a weight used by two different matmuls cannot be tensor-parallel",
        )
    p.meta[META_SHARD] = shard


def _split_column(gm: fx.GraphModule, f: Matmul, strided: int) -> None:
    _set_shard(f.weight, TPShard(f.col_dim, strided))
    if f.bias is not None:
        _set_shard(f.bias, TPShard(0, strided))
    f.node.meta[META_ROLE] = "column"
    tp_copy_of(gm, f.x, f.node)


VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def tp_copy_of(gm: fx.GraphModule, x: fx.Node, user: fx.Node) -> fx.Node:
    """Route ``user``'s input ``x`` through the one ``tp_copy`` (f) of x's source: f goes before
    any chain of views that flattens (b, s, h) to (b·s, h), so it sees the natural shape."""
    while x.target in VIEWS and len(x.users) == 1:
        user, x = x, node_arg(x, 0)
    copy = next((u for u in x.users if u.target == ops.tp_copy.default), None)
    if copy is None:
        with gm.graph.inserting_after(x):
            copy = gm.graph.call_function(ops.tp_copy.default, (x, "tp"))
        copy.meta.update({k: v for k, v in x.meta.items() if not k.startswith(META_INPUT)})
    user.replace_input_with(x, copy)
    return copy


def _split_row(gm: fx.GraphModule, f: Matmul) -> None:
    _set_shard(f.weight, TPShard(f.row_dim, 1))
    n = f.node
    n.meta[META_ROLE] = "row"
    g = gm.graph
    with g.inserting_after(n):
        if n.target == aten.linear.default:
            mm = g.call_function(aten.linear.default, (f.x, f.weight))
        elif n.target == aten.addmm.default:
            mm = g.call_function(aten.mm.default, (f.x, f.weight))
        else:
            assert callable(n.target)
            mm = g.call_function(n.target, (f.x, f.weight))
    mm.meta.update({k: v for k, v in n.meta.items() if k != META_ROLE})
    mm.meta[META_ROLE] = "row"
    n.replace_all_uses_with(mm)
    g.erase_node(n)
    last = mm  # g goes after views that restore (b, s, h), so it sees the natural shape
    while (
        len(last.users) == 1
        and (u := next(iter(last.users))).target in VIEWS
        and (tensor_of(u).shape[-1] == tensor_of(mm).shape[-1])
    ):
        last = u
    with g.inserting_after(last):
        reduced = g.call_function(ops.tp_reduce.default, (last, "tp"))
    out = reduced
    if f.bias is not None:
        with g.inserting_after(reduced):
            out = g.call_function(aten.add.Tensor, (reduced, f.bias))
    for new in {reduced, out}:
        new.meta.update({k: v for k, v in last.meta.items() if k not in ("val", META_ROLE)})
    last.replace_all_uses_with(out, delete_user_cb=lambda u: u is not reduced)


def sum_partial_grads(gm: fx.GraphModule, dims: dict[fx.Node, int], skip: set[fx.Node]) -> None:
    """Route every replicated operand that carries a gradient into a split op of ``dims``
    (other than those of ``skip``: a column matmul, whose input already has f, a key/value
    head select, whose inputs ``_select_heads`` routed) through ``tp_all_reduce_grad``: the
    op's backward on one rank covers only that rank's part of the split dim. A parameter
    split over tp is not such an operand (its gradient is its own slice's)."""
    carries = from_parameters(gm)
    reduced: dict[fx.Node, fx.Node] = {}
    for n in list(dims):
        if n in skip:
            continue
        for a in n.all_input_nodes:
            if (
                a in dims
                or a not in carries
                or a.target == ops.tp_copy.default
                or a.meta.get(META_SHARD) is not None
            ):
                continue
            n.replace_input_with(a, _grad_summed(gm, a, reduced))


def _grad_summed(gm: fx.GraphModule, a: fx.Node, reduced: dict[fx.Node, fx.Node]) -> fx.Node:
    """``a`` through one ``tp_all_reduce_grad`` (shared by the callers that pass ``reduced``)."""
    if a not in reduced:
        with gm.graph.inserting_after(a):
            reduced[a] = gm.graph.call_function(ops.tp_all_reduce_grad.default, (a, "tp"))
        reduced[a].meta.update({k: v for k, v in a.meta.items() if not k.startswith(META_INPUT)})
    return reduced[a]


_COLLECTIVES = (ops.tp_copy.default, ops.tp_reduce.default, ops.tp_all_reduce_grad.default)
_SDPA = aten.scaled_dot_product_attention.default
_PRODUCTS = (aten.matmul.default, aten.bmm.default)


def _kv_columns(sp, tp: int) -> set[fx.Node]:
    """Column matmuls whose split would cut key/value heads (fewer of them than tp, or a count
    tp does not divide) and whose split reaches nothing but attentions' keys and values: they
    are kept whole on every rank, and each rank takes its heads at the attention
    (``_select_heads``). Megatron replicates such heads too."""
    cut: set[fx.Node] = set()
    for n, d in sp.dims.items():
        val = tensor_val(n)
        if val is None or not isinstance(val.shape[d], int) or val.shape[d] % tp == 0:
            continue
        columns, seen, work = set(), {n}, [n]
        while work:  # back to the column matmuls the indivisible split came from
            m = work.pop()
            if m in sp.columns:
                columns.add(m)
            for a in m.all_input_nodes:
                if a in sp.dims and a not in seen:
                    seen.add(a)
                    work.append(a)
        if columns and all(_only_keys_values(sp, c) for c in columns):
            cut |= columns
    return cut


def _from(n: fx.Node, columns: set[fx.Node]) -> bool:
    """``n`` is computed from one of ``columns`` (matmuls), through anything but matmuls."""
    seen, work = {n}, [n]
    while work:
        m = work.pop()
        if m in columns:
            return True
        if matmul_form(m) is not None:
            continue
        for a in m.all_input_nodes:
            if a not in seen:
                seen.add(a)
                work.append(a)
    return False


def _only_keys_values(sp, column: fx.Node) -> bool:
    """The split of ``column`` reaches attentions as their keys or values only (an SDPA's k
    or v, or one operand of an activation matmul whose other operand it does not reach), and
    no row matmul, output or op the split cannot pass."""
    seen, work, products = {column}, [column], []
    while work:
        n = work.pop()
        for u in n.users:
            if u.target == _SDPA:
                if u.args[0] is n:
                    return False
                products.append((u, u.args[0]))
            elif u.target in _PRODUCTS and matmul_form(u) is None:
                products.append((u, u.args[1] if u.args[0] is n else u.args[0]))
            elif u in sp.rows or u in sp.ends or u in sp.problems or u.op == "output":
                return False
            elif u in sp.dims and u not in seen:
                seen.add(u)
                work.append(u)
    return bool(products) and all(other not in seen for _, other in products)


def _kv_heads_unfit(n: fx.Node, tp: int) -> str | None:
    """Why attention ``n``'s replicated keys and values cannot be shared out by heads over tp
    ranks (a count neither a multiple nor a divisor of tp, or unequal counts); None if they can."""
    k, v = tensor_of(node_arg(n, 1)), tensor_of(node_arg(n, 2))
    heads = k.shape[-3]
    if not isinstance(heads, int) or heads != v.shape[-3]:
        return f"keys and values of unequal or unknown head counts {k.shape[-3]}, {v.shape[-3]}"
    if heads % tp and tp % heads:
        return f"{heads} key/value heads, which tp = {tp} neither divides nor is a multiple of"
    return None


def _select_heads(gm: fx.GraphModule, sp, tp: int) -> list[fx.Node]:
    """Each replicated operand a split op reads whole (``tp_rules.narrowed``: an attention's
    keys and values when only its queries are split, the keys of an eager attention's
    products) is cut to this rank's part by ``index_select``: rows ``tp_rank · H/tp +
    arange(H/tp)`` of its H along the split dim when tp divides H, else (SDPA's grouped
    keys, tp a multiple of H) the one row ``tp_rank // (tp/H)``, the head every local query
    head shares. The selects join ``sp.dims``.

    Their gradient on one rank covers only its part, so every replicated value that carries a
    gradient into them is summed over tp (``_route_partial``)."""
    cuts = [(n, src, d) for n in list(sp.dims) for src, d in narrowed(n, sp.dims)]
    selects: list[fx.Node] = []
    rank = None
    g = gm.graph
    for n, src, d in cuts:
        user, passed = n, []  # the select goes before a transpose read by n alone (an eager
        while src.target == aten.transpose.int and len(src.users) == 1:  # attention's kᵀ)
            a, b = (_norm_dim(int_arg(src, i), tensor_of(src).dim()) for i in (1, 2))
            passed.append((src, d))  # the transpose, split along d once it reads the select
            user, src, d = src, node_arg(src, 0), b if d == a else a if d == b else d
        rows = int(tensor_of(src).shape[d])
        rank = rank or _tp_rank(gm)
        # a rebuilt position mask reads its key length from the keys (sequence_chunk lengthens
        # it by the prefix's through them): it reads the select's, the same length
        sizes = [u for u in src.users if u.meta.get(META_MASK_FN) == "keys"]
        order = {m: i for i, m in enumerate(g.nodes)}
        # each cut its own index, before its own first reader (an attention's two cuts can sit
        # in either order: v's projection written first, k's after a norm)
        with g.inserting_before(min([user, *sizes], key=order.__getitem__)):
            made = _head_index(g, rank, rows, tp, tensor_of(src).device)
            sel = g.call_function(aten.index_select.default, (src, d, made[-1]))
        for new in (*made, sel):
            new.meta.update(_derived_meta(src))
        sp.dims[sel] = d
        selects.append(sel)
        for u in (user, *sizes):
            u.replace_input_with(src, sel)
        sp.dims.update(passed)
    if selects:
        _route_partial(gm, selects)
    return selects


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _derived_meta(src: fx.Node) -> dict:
    """``src``'s meta for a node computed from it: its module and layer, not its value, input
    reference, shard or role."""
    drop = ("val", META_INPUT, META_SHARD, META_TP_SPLIT, META_ROLE)
    return {k: v for k, v in src.meta.items() if k not in drop}


def _route_partial(gm: fx.GraphModule, selects: list[fx.Node]) -> None:
    """Sum over tp every gradient that the key/value head ``selects`` send back.

    The *chain* is the replicated computation whose every use leads only into the selects
    (the keys' projection, reshapes, rotary, the GQA repeat): its gradient on one rank is that
    rank's share, so each value that enters the chain from outside and carries a gradient is
    routed through ``tp_all_reduce_grad`` — a matmul's input through the region's f
    (``tp_copy``), which sums it with the query's share — and the ranks' shares add up to the
    whole. The chain stops at tp collectives, whose backward expects a whole gradient, and at
    ops that compute in a less precise dtype than the keys (a float32 norm in a float64 model):
    the shares are summed before the gradient is rounded to it, as one device rounds the whole."""
    carries = from_parameters(gm)
    eps = torch.finfo(tensor_of(node_arg(selects[0], 0)).dtype).eps
    chain: set[fx.Node] = set()
    work = [node_arg(s, 0) for s in selects]
    while work:
        n = work.pop()
        if n in chain or n.op != "call_function" or n not in carries or n.target in _COLLECTIVES:
            continue
        if any(
            v.is_floating_point() and torch.finfo(v.dtype).eps > eps
            for v in map(tensor_val, [n, *n.all_input_nodes])
            if v is not None
        ):
            continue
        if any(u not in chain and u not in selects for u in n.users):
            continue  # a later user joining the chain visits it again
        chain.add(n)
        work.extend(n.all_input_nodes)
    reduced: dict[fx.Node, fx.Node] = {}
    for n in [*chain, *selects]:
        form = matmul_form(n) if n in chain else None
        for a in n.all_input_nodes:
            if a in chain or a not in carries:
                continue
            if form is not None and a is form.x:
                tp_copy_of(gm, a, n)
            else:
                n.replace_input_with(a, _grad_summed(gm, a, reduced))


def _rewrite_constants(
    n: fx.Node, dims: dict[fx.Node, int], tp: int, grouped: bool = False
) -> None:
    if n.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        _, idx = view_map(n, dims[node_arg(n, 0)], grouped)
        _divide(n, 1, idx, tp)
    elif n.target == aten.expand.default:
        _divide(n, 1, dims[n], tp)
    elif n.target == aten.split.Tensor and _along(n, dims):
        n.update_arg(1, int_arg(n, 1) // tp)
    elif n.target == aten.split_with_sizes.default and _along(n, dims):
        n.update_arg(1, [s // tp for s in seq_arg(n, 1)])


def _along(n: fx.Node, dims: dict[fx.Node, int]) -> bool:
    src = node_arg(n, 0)
    return int_arg(n, 2, "dim", 0) % tensor_of(src).dim() == dims[src]


def _divide(n: fx.Node, arg: int, idx: int, tp: int) -> None:
    shape = list(seq_arg(n, arg))
    if isinstance(shape[idx], int) and shape[idx] != -1:
        shape[idx] //= tp
        n.update_arg(arg, shape)


def localize(gm: fx.GraphModule, tp: int) -> None:
    """Give every split parameter placeholder its local (per-rank) fake value; refuse a split
    parameter that some op would still read whole."""
    for p in gm.graph.nodes:
        shard = p.meta.get(META_SHARD) if p.op == "placeholder" else None
        if shard is None:
            continue
        for u in p.users:
            if META_ROLE not in u.meta:
                raise AutopartError(
                    f"parameter {p.meta['autopart.input'].name} is split over tp but node "
                    f"{u.name} ({getattr(u.target, '__name__', u.target)}) of module "
                    f"{u.meta.get(META_MODULE) or '<root>'} reads it whole",
                    hint="tp splits this weight for its matmuls (the vocabulary of a tied "
                    "embedding, say), and a weight read whole elsewhere too cannot be split; run "
                    "this model without tp, or read the weight only through its matmuls",
                )
        full = p.meta.get(META_GLOBAL_VAL, p.meta["val"])
        p.meta[META_GLOBAL_VAL] = full
        shape = list(full.shape)
        shape[shard.dim] //= tp
        p.meta["val"] = fake_like(full, tuple(shape))
