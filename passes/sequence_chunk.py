"""sequence_chunk: after this pass every stage graph runs one sequence chunk of a micro-batch.

Invariant (Seq1F1B plans): cut a micro-batch's sequence into chunks of lengths s_0 … s_{k−1}.
Running a stage graph on chunk j — its tokens (or the previous stage's activations for them),
``offset`` = s_0 + … + s_{j−1}, for each attention layer the K/V *prefix* of the chunks before
it, for each causal convolution the inputs it *carries* over from them, for each state scan
and linear recurrence the state they ended with, and for each running product, log-sum-exp,
maximum or minimum its value at their last token — returns the chunk's outputs and, appended,
each attention layer's K/V with this chunk's added (the next chunk's prefix), each causal
convolution's last (k − 1)·d inputs, each scan's state and each running value after the chunk
(the next chunk's carries). Chunk lengths
are multiples of every scan's block of Q tokens (``meta["autopart.seq_block"]``).
Together the chunks compute exactly what the unchunked graph computes on the whole sequence;
the loss output is the chunk's summed cross entropy, so the chunks' losses add up to the
sequence's. Gradients reaching a prefix or carry input belong to earlier chunks' outputs: the
runtime hands them back to those chunks' backward, which runs later (reverse chunk order).
A carry is a prefix to the runtime (``InputRef("kv", …)``, an empty first one, the previous
chunk's output after it): it keeps only the last (k − 1)·d positions.

What changes in the graph:

- **inputs**: ``InputRef("offset", "")`` (a 0-d int64 tensor) when the stage computes
  positions, then ``InputRef("kv", "2i")`` / ``("kv", "2i+1")`` — layer i's K and V prefix,
  ``[..., P, head_dim]`` with a symbolic prefix length P (0 for the first chunk), then
  ``InputRef("kv", "2A+j")`` — the carried inputs of the stage's j-th causal convolution,
  ``[b, channels, W_j]`` with a symbolic length of its own (0 for the first chunk, then the
  convolution's window (k − 1)·d), then ``("kv", "2A+C+j")`` — the state the j-th state scan
  (``seq_rules.StateScan``) ended the previous chunk with, one block long (0 for the first
  chunk), then one per linear recurrence (``seq_rules.Recurrence``: a rolled-up token loop, a
  cumsum of values) and one per running scan (``seq_rules.CarriedScan``), one token long (0
  for the first chunk);
- **positions**: every ``arange`` over the sequence length from 0 (learned positions, rotary
  tables, Hugging Face's ``cache_position``) becomes ``arange(s) + offset``, and every running
  count ``cumsum(full(c))`` (OPT's positions from an all-ones mask) gains ``c · offset``;
- **attention** (only the causal SDPA canonicalize_attention leaves): K and V are concatenated
  after their prefix, and the causal mask is aligned lower-right — query t of the chunk sees key
  positions ≤ P + t, and > P + t − W under a sliding window of W keys
  (``torch.nn.attention.bias.causal_lower_right``'s mask, built in the graph from the sizes, so
  one graph serves every chunk);
- **causal convolutions** (``seq_rules.causal_conv``: stride 1, zero-padded by their window
  (k − 1)·d on the left only): the convolution runs unpadded over [window; chunk], where the
  window is the last (k − 1)·d entries of [zeros; carried inputs] — the zero padding for the
  first chunk, the previous chunk's last inputs after it — so its output has the chunk's
  length and equals the whole sequence's at these tokens;
- **token shifts** (``seq_rules.TokenShift``: a zero pad by p before the sequence and −p after
  it, RWKV's time shift): ``[window; chunk]`` without its last p entries, the window being the
  last p entries of [zeros; carried inputs], as for a convolution;
- **state scans** (Mamba-2's SSD): the scan starts from the last block of [zeros; carried
  state] instead of its zeros, so each chunk continues the recurrence where the previous one
  stopped; a linear recurrence (``autopart::linear_scan``) starts from the carried state;
- **running scans** (``cumprod``, ``logcumsumexp``, ``cummax``, ``cummin`` along the sequence):
  the scan runs over [carry; chunk] and its users read it from the carry's length on: each
  value is computed from the one before exactly as in the unchunked scan;
- **sliding windows**: a layer with a window of W keys (an SDPA's, or a general form's that
  ``position_masks.score_window`` proved) hands on only the last W − 1 positions of its
  [prefix; chunk] K and V (all a later query sees), and its prefix input has a symbolic length
  of its own;
- **outputs**: the stage's outputs, then the K, V of every attention layer (whole, or trimmed
  to the window), in order,
  then each convolution's last (k − 1)·d inputs of [window; chunk] (some the carry's when the
  chunk is shorter than the window), then each token shift's last p inputs, then each scan's
  state and each running value after the chunk. Each prefix and
  carry travels in the dtype of the value it carries (GPT-J's float32 keys, an integer running
  count, a float32 state in a bf16 model: rounded to the model's dtype they would differ from
  the unchunked run's; ``autopart.graph.kv_dtypes`` tells the runtime);
- **views** become reshapes (same values; the prefixed attention's output may have other
  strides than the unchunked one had).

A stage with attention the previous pass could not prove causal is refused (Seq1F1B needs it),
and so is one where tokens meet along the sequence anywhere else (``refuse_sequence_mixing``).
"""

from __future__ import annotations

import math
import operator
from typing import Any, cast

import sympy
import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import DimDynamic
from torch.utils._sympy.value_ranges import ValueRanges

from autopart.errors import AutopartError
from autopart.frontend.capture import B, InputRef
from autopart.frontend.shapes import propagate
from autopart.graph import erase_unused, remove_dead
from autopart.layout import Plan
from autopart.meta import (
    META_ATTENTION,
    META_DATA_MASK,
    META_EXAMPLE_SHAPE,
    META_INPUT,
    META_INPUTS,
    META_KV,
    META_KV_SHAPES,
    META_LAYER,
    META_MASK_FN,
    META_MODULE,
    META_RANGES,
    META_RECOMPUTE,
    META_SCORES,
    META_SEQ_BLOCK,
    META_SEQ_DIM,
    META_SYMBOLS,
    META_WINDOW,
)
from autopart.node_args import float_arg, node_arg
from autopart.passes.canonicalize_attention import SDPA, lower_right_mask, require_causal
from autopart.passes.pipeline_split import stage_graphs
from autopart.passes.seq_rules import (
    CONVS,
    LINEAR_SCAN,
    SOFTMAX,
    CarriedScan,
    CausalConv,
    Recurrence,
    Seq,
    StateScan,
    TokenShift,
    carried_scan,
    causal_conv,
    fill_value,
    filled_with,
    is_length,
    is_positions,
    is_scored,
    live_nodes,
    recurrence,
    scored_qkv,
    seq_dims,
    state_scan,
    table_rows,
    token_shift,
)

aten = torch.ops.aten
P = sympy.Symbol("p", nonnegative=True, integer=True)  # KV prefix length, for cost formulas


def sequence_chunk(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if not plan.chunked:
        return gm
    block = 1
    example = gm.meta.get(META_EXAMPLE_SHAPE, (0, 0))[1]
    for st in stage_graphs(gm):
        require_causal(st)
        running_sums(st)
        shifts_as_pads(st)
        refuse_sequence_mixing(st, example)
        block = math.lcm(block, st.meta[META_SEQ_BLOCK])
        chunk_stage(st)
    gm.meta[META_SEQ_BLOCK] = block  # compile makes the plan's chunk boundaries multiples of it
    return gm


def running_sums(gm: fx.GraphModule) -> None:
    """Each cumsum along the sequence (of values, not a running count of a constant, which
    the chunk pass shifts by the chunk's offset) written as the linear recurrence it is,
    ``autopart::linear_scan(1, x, d)``: h[t] = h[t − 1] + x[t], so a chunk needs only the last
    sum of the chunk before it, which the chunk pass carries like any ``Recurrence`` (OPT's
    positions from a padded attention mask, a running mean, linear attention written with
    cumsum were refused as "a cumsum along the sequence"). Integers and booleans are summed in
    int64, as cumsum sums them."""
    g = gm.graph
    changed = False
    for n in list(g.nodes):
        if n.target != aten.cumsum.default or n.meta.get(META_MASK_FN) or fill_value(n, gm):
            continue
        x, val = n.args[0], n.meta.get("val")
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if not (isinstance(x, fx.Node) and isinstance(val, torch.Tensor) and isinstance(dim, int)):
            continue
        if not is_length(x, dim, gm) or val.dim() == 0:
            continue
        with g.inserting_before(n):
            src = x
            if x.meta["val"].dtype != val.dtype:  # an explicit dtype=, or an integer sum
                src = g.call_function(aten._to_copy.default, (x,), {"dtype": val.dtype})
            ones = g.call_function(aten.ones_like.default, (src,))
            scan = g.call_function(LINEAR_SCAN, (ones, src, dim % val.dim()))
        for new in {src, ones, scan} - {x}:
            new.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        scan.meta["val"] = val  # the cumsum's: a cumsum of it reads its length before propagate
        n.replace_all_uses_with(scan)
        g.erase_node(n)
        changed = True
    if changed:
        gm.recompile()
        propagate(gm)


def shifts_as_pads(gm: fx.GraphModule) -> None:
    """Each token shift written as a concatenation, ``cat([zeros(p), x[:, :−p]], d)`` (zeros
    from ``zeros``, ``zeros_like``, ``new_zeros`` or a ``full`` of 0, p long along d, in x's
    dtype), rewritten as the zero pad it equals, ``pad(x, […, p, −p])`` along d: the
    form ``seq_rules.TokenShift`` proves and the chunk pass carries (it was refused as "a slice
    of the sequence"). Same values and gradients; any other concatenation is left as it is."""
    g = gm.graph
    changed = False
    for n in list(g.nodes):
        form = _cat_shift(n)
        if form is None:
            continue
        x, d, p = form
        nd = x.meta["val"].dim()
        with g.inserting_before(n):
            pad = g.call_function(  # (fake constant_pad_nd cannot cut a symbolic length)
                aten.pad.default, (x, [0, 0] * (nd - 1 - d) + [p, -p], "constant", 0.0)
            )
        pad.meta.update({k: v for k, v in n.meta.items()})
        n.replace_all_uses_with(pad)
        erase_unused(g, n)
        changed = True
    if changed:
        gm.recompile()
        propagate(gm)


def _cat_shift(n: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(x, d, p) when ``n`` is ``cat([zeros p long along d, x[0 : −p] along d], d)``."""
    if n.op != "call_function" or n.target != aten.cat.default:
        return None
    parts = n.args[0]
    d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and isinstance(d, int)):
        return None
    z, cut = parts
    if not (isinstance(z, fx.Node) and isinstance(cut, fx.Node)):
        return None
    if cut.target != aten.slice.Tensor or filled_with(z) != 0:
        return None
    x = node_arg(cut, 0)
    xv, zv, val = x.meta.get("val"), z.meta.get("val"), n.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(zv, torch.Tensor)):
        return None
    if not isinstance(val, torch.Tensor) or zv.dtype != xv.dtype:
        return None
    d %= xv.dim()
    args = [*cut.args, *([None] * 5)][:5]
    dim, start, end, step = args[1], args[2], args[3], args[4]
    step = 1 if step is None else step
    if not isinstance(dim, int) or dim % xv.dim() != d or start not in (None, 0) or step != 1:
        return None
    p = zv.shape[d]
    if not (isinstance(end, int) and isinstance(p, int) and p > 0 and end == -p):
        return None
    return x, d, p


def chunk_stage(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite one stage graph in place to run one chunk (see the module docstring)."""
    g = gm.graph
    refs = gm.meta.get(META_INPUTS)  # a pipeline stage's input list (else from meta)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    last_ph = placeholders[-1]
    output = next(n for n in g.nodes if n.op == "output")
    attention = [
        n
        for n in g.nodes
        if (n.target == SDPA and n.meta.get(META_ATTENTION) == "causal") or is_scored(n)
    ]
    positions = [n for n in g.nodes if is_positions(n, gm)]
    counts = {n: c for n in g.nodes if (c := fill_value(n, gm)) is not None}
    rows = {n: d for n in g.nodes if (d := table_rows(n, gm)) is not None}

    new_refs: list[InputRef] = []
    mode = detect_fake_mode([n.meta["val"] for n in placeholders])
    anchor = last_ph
    offset = None
    if positions or counts or rows:
        with g.inserting_after(anchor):
            offset = g.placeholder("chunk_offset")
        assert mode is not None  # export's graphs carry fake values
        with mode:
            offset.meta["val"] = torch.zeros((), dtype=torch.int64)
        offset.meta[META_INPUT] = InputRef("offset", "")
        new_refs.append(offset.meta[META_INPUT])
        anchor = offset
    # a sliding window of W keys needs only the last W − 1 of them from earlier chunks: such a
    # layer's prefix has a length of its own (trimmed), every other layer's the shared P
    trimmed = {
        i: _prefix_symint(cast(Any, mode), f"autopart_kv_window_{i}")
        for i, sdpa in enumerate(attention)
        if (sdpa.meta.get(META_WINDOW) or 0) > 1 and not sdpa.meta.get(META_DATA_MASK)
    }
    prefix_len = _prefix_symint(mode) if len(trimmed) < len(attention) else None
    prefixes: list[tuple[fx.Node, fx.Node]] = []
    for i, sdpa in enumerate(attention):
        pair = []
        for j, src in enumerate(_qkv(sdpa)[1:]):
            with g.inserting_after(anchor):
                ph = g.placeholder(f"kv_prefix_{i}_{'kv'[j]}")
            val = src.meta["val"]
            shape = [*val.shape[:-2], trimmed.get(i, prefix_len), val.shape[-1]]
            assert mode is not None
            with mode:
                ph.meta["val"] = torch.empty(shape, dtype=val.dtype, device=val.device)
            ph.meta[META_INPUT] = InputRef("kv", str(2 * i + j))
            ph.meta[META_MODULE], ph.meta[META_LAYER] = (
                sdpa.meta.get(META_MODULE, ""),
                sdpa.meta.get(META_LAYER),
            )
            new_refs.append(ph.meta[META_INPUT])
            pair.append(ph)
            anchor = ph
        prefixes.append((pair[0], pair[1]))
    # the batch's padding / documents: their key columns, the prefix's and the chunk's tokens
    keys: dict[str, fx.Node] = {}
    for name in ("attention_mask", "position_ids"):
        if not any(name in (n.meta.get(META_DATA_MASK) or ()) for n in attention):
            continue
        query = next(p for p in placeholders if p.meta.get(META_INPUT) == InputRef("data", name))
        b, s = query.meta["val"].shape
        with g.inserting_after(anchor):
            ph = g.placeholder(f"keys_{name}")
        assert mode is not None  # export's graphs carry fake values
        with mode:
            ph.meta["val"] = torch.empty((b, prefix_len + s), dtype=query.meta["val"].dtype)
        ph.meta[META_INPUT] = InputRef("keys", name)
        ph.meta[META_MODULE], ph.meta[META_LAYER] = "", None
        new_refs.append(ph.meta[META_INPUT])
        keys[name] = ph
        anchor = ph
    # a causal convolution's carried inputs, then a state scan's carried state: each a ``kv``
    # input whose dim ``dim`` of the value ``like`` has a symbolic length of its own
    carried: list[tuple[Any, fx.Node, torch.SymInt]] = []
    for name, found, like, dim, at in (
        *(("conv_carry", c, c.x, c.dim, c.conv) for c in _causal_convs(gm)),
        *(("shift_carry", t, t.x, t.dim, t.node) for t in _token_shifts(gm)),
        *(("scan_state", c, c.zeros, c.dim, c.einsum) for c in _state_scans(gm)),
        *(("recurrence_state", r, r.b, r.dim, r.node) for r in _recurrences(gm)),
        *(("scan_carry", c, c.value, c.dim, c.node) for c in _carried_scans(gm)),
    ):
        i = sum(1 for f, _, _ in carried if type(f) is type(found))
        with g.inserting_after(anchor):
            ph = g.placeholder(f"{name}_{i}")
        val = like.meta["val"]
        assert mode is not None  # export's graphs carry fake values
        length = _prefix_symint(mode, f"autopart_{name}_{i}")
        shape = [*val.shape[:dim], length, *val.shape[dim + 1 :]]
        with mode:
            ph.meta["val"] = torch.empty(shape, dtype=val.dtype, device=val.device)
        ph.meta[META_INPUT] = InputRef("kv", str(2 * len(prefixes) + len(carried)))
        ph.meta[META_MODULE], ph.meta[META_LAYER] = (
            at.meta.get(META_MODULE, ""),
            at.meta.get(META_LAYER),
        )
        new_refs.append(ph.meta[META_INPUT])
        carried.append((found, ph, length))
        anchor = ph
    carries = [(c, ph, n) for c, ph, n in carried if isinstance(c, CausalConv)]
    shifts = [(c, ph, n) for c, ph, n in carried if isinstance(c, TokenShift)]
    states = [(c, ph, n) for c, ph, n in carried if isinstance(c, StateScan)]
    recurrences = [(c, ph, n) for c, ph, n in carried if isinstance(c, Recurrence)]
    scans = [(c, ph, n) for c, ph, n in carried if isinstance(c, CarriedScan)]

    for n in positions:
        with g.inserting_after(n):
            shifted = g.call_function(aten.add.Tensor, (n, offset))
        n.replace_all_uses_with(shifted, delete_user_cb=lambda u, s=shifted: u is not s)
    for n, d in rows.items():  # table[..., 0:s] → the rows offset … offset + s − 1
        table, length = node_arg(n, 0), n.args[3]
        with g.inserting_after(n):
            index = g.call_function(
                aten.arange.default,
                (length,),
                {"dtype": torch.int64, "device": n.meta["val"].device},
            )
        with g.inserting_after(index):
            shifted = g.call_function(aten.add.Tensor, (index, offset))
        with g.inserting_after(shifted):
            read = g.call_function(aten.index_select.default, (table, d, shifted))
        for m in (index, shifted, read):
            m.meta[META_MODULE], m.meta[META_LAYER] = (
                n.meta.get(META_MODULE, ""),
                n.meta.get(META_LAYER),
            )
        n.replace_all_uses_with(read)
    for n, c in counts.items():  # cumsum of c over the chunk + c · offset: the whole count
        with g.inserting_after(n):
            before = g.call_function(aten.mul.Tensor, (offset, c))
        with g.inserting_after(before):
            shifted = g.call_function(aten.add.Tensor, (n, before))
        n.replace_all_uses_with(shifted, delete_user_cb=lambda u, s=shifted: u is not s)

    # attention over [prefix; chunk] may lay its output out differently from the unchunked
    # SDPA, so a later ``view`` of it can fail at run time (Falcon); in a functional graph
    # ``reshape`` computes the same values and copies only when a view is impossible
    for n in g.nodes:
        if n.target == aten.view.default:
            n.target = aten.reshape.default
    kv_out: list[fx.Node] = []
    masks: dict[tuple[str, ...], fx.Node] = {}  # one document mask per stage, shared by layers
    for i, (sdpa, (kp, vp)) in enumerate(zip(attention, prefixes, strict=True)):
        kv_out += _attend_with_prefix(g, sdpa, kp, vp, keys, masks, trim=i in trimmed)
    for conv, ph, _ in carries:
        kv_out.append(_convolve_with_carry(g, conv, ph))
    for shift, ph, _ in shifts:
        kv_out.append(_shift_with_carry(g, shift, ph))
    for scan, ph, _ in states:
        kv_out.append(_scan_from_state(g, scan, ph))
    for rec, ph, _ in recurrences:
        kv_out.append(_recur_from_state(g, rec, ph))
    for running, ph, _ in scans:
        kv_out.append(_continue_scan(g, running, ph))

    outs = output.args[0]
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    output.args = (outs + tuple(kv_out),)
    if refs is not None:
        gm.meta[META_INPUTS] = [*refs, *new_refs]
    gm.meta[META_KV] = len(kv_out)
    kv_shapes = [
        _empty_prefix(ph, cast(torch.SymInt, trimmed.get(i, prefix_len)), gm)
        for i, pair in enumerate(prefixes)
        for ph in pair
    ]
    gm.meta[META_KV_SHAPES] = kv_shapes + [
        _empty_prefix(ph, n, gm) for _, ph, n in [*carries, *shifts, *states, *recurrences, *scans]
    ]
    lengths = [(prefix_len, P)] if prefix_len is not None else []
    lengths += [(length, _window_symbol(i)) for i, length in trimmed.items()]
    lengths += [(length, _carry_symbol(i)) for i, (_, _, length) in enumerate(carries)]
    lengths += [(length, _shift_symbol(i)) for i, (_, _, length) in enumerate(shifts)]
    lengths += [(length, _state_symbol(i)) for i, (_, _, length) in enumerate(states)]
    lengths += [(n, _recurrence_symbol(i)) for i, (_, _, n) in enumerate(recurrences)]
    lengths += [(n, _scan_symbol(i)) for i, (_, _, n) in enumerate(scans)]
    if lengths:
        rc = dict(gm.meta.get(META_RANGES, {}))
        names = dict(gm.meta.get(META_SYMBOLS, {}))
        for sym, name in lengths:
            rc[sym.node.expr] = ValueRanges(0, sympy.oo)
            names[sym.node.expr] = name
        gm.meta[META_RANGES], gm.meta[META_SYMBOLS] = rc, names
    # the construction of a mask replaced above (a batch's: it indexes the whole sequence, so
    # run on a chunk it would fail) goes, with the metadata asserts fx keeps as impure
    remove_dead(gm)
    g.lint()
    gm.recompile()
    propagate(gm)
    return gm


def refuse_sequence_mixing(gm: fx.GraphModule, example: int = 0) -> None:
    """Refuse a stage unless every live node is proven to keep tokens apart (``seq_rules``).

    The proof is an allow-list: every node's value at token t must depend only on tokens ≤ t
    through a construct this pass chunks (position-wise ops, positions, causal attention with
    its K/V prefix, causal convolutions with their carried window, token shifts with their
    carried inputs, state scans with their
    carried state, the summed loss, routed experts). The first node that is not proven is
    named, with its module and the construct; an unrecognized softmax over the sequence is named
    first when there is one (an attention ``canonicalize_attention`` did not recognize explains
    the rest: its scores pair tokens, its mask's construction scans them). A scan whose blocks
    the ``example`` sequence (its length) does not fill twice is named first: export fixes such
    a scan's sizes at the example's one block. Each proven node keeps its sequence dim in
    ``meta["autopart.seq_dim"]``.
    """
    env, found, block = seq_dims(gm)
    gm.meta[META_SEQ_BLOCK] = block
    for n, value in env.items():
        n.meta[META_SEQ_DIM] = value.dim if isinstance(value, Seq) else None
    if found and block > 1 and 0 < example < 2 * block:
        raise AutopartError(
            f"Seq1F1B cannot chunk this stage: its state scan works on blocks of {block} tokens "
            f"and the example sequence has {example}, less than two blocks, so export fixed the "
            f"scan's sizes at one block (the proof then stops at {found[0][0].name}: "
            f"{found[0][1]})",
            hint=f"capture with an example of at least {2 * block} tokens (Seq1F1B cuts chunks "
            f"at whole blocks of {block}) for the proof to see the whole scan: a scan in "
            "Mamba-2's form (one product over every block's state) then chunks, while one "
            "written as a Python loop over the blocks (the gated delta rule of Qwen3-Next, "
            "Qwen3.5 and Kimi Linear) stays refused at any length; docs/capture.md explains why",
        )
    if found:
        n, what = min(found, key=lambda f: SOFTMAX not in f[1])
        raise AutopartError(
            f"Seq1F1B cannot chunk node {n.name} ({n.meta.get(META_MODULE) or '<root>'}): {what}",
            hint="use the 1f1b or interleaved-1f1b schedule for this model (Seq1F1B chunks "
            "position-wise ops, positions from arange or a running count, causal attention, "
            "causal convolutions, token shifts, state scans, linear recurrences, running sums, "
            "products, log-sum-exps, maxima and minima, and routed experts; docs/seq1f1b.md "
            "lists them)",
        )


def _empty_prefix(ph: fx.Node, prefix_len: torch.SymInt, gm: fx.GraphModule) -> list[int | str]:
    """The first chunk's prefix shape: 0 tokens, "b" where the batch goes, other sizes fixed
    (head counts and widths; under tp they may be expressions of s that are constant for the
    chunk lengths allowed, so they are evaluated at the example)."""
    names = gm.meta.get(META_SYMBOLS, {})
    out: list[int | str] = []
    for d in ph.meta["val"].shape:
        if not isinstance(d, torch.SymInt):
            out.append(int(d))
        elif d.node.expr == prefix_len.node.expr:
            out.append(0)
        elif names.get(d.node.expr) == B:
            out.append("b")
        elif d.node.expr.free_symbols & {k for k, v in names.items() if v == B}:
            raise AutopartError(
                f"{ph.name}: a K/V layout whose size {d} mixes the batch into another dim",
                hint="Seq1F1B needs K/V as (batch, ..., sequence, head_dim); please report the model",
            )
        else:
            out.append(int(d.node.shape_env.guarding_hint_or_throw(d.node.expr)))
    return out


def _prefix_symint(mode, name: str = "autopart_kv_prefix") -> torch.SymInt:
    """A fresh symbolic size for a prefix length (hinted at 16: never specialized to 0 or 1)."""
    env = mode.shape_env
    sym = env.create_symbol(16, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(sym, hint=16)


def _window_symbol(i: int) -> sympy.Symbol:
    """The prefix length of windowed attention ``i`` for cost formulas (0, then < its window)."""
    return sympy.Symbol(f"p{i}", nonnegative=True, integer=True)


def _carry_symbol(i: int) -> sympy.Symbol:
    """The length of conv ``i``'s carried inputs, for cost formulas (0, then its window)."""
    return sympy.Symbol(f"w{i}", nonnegative=True, integer=True)


def _shift_symbol(i: int) -> sympy.Symbol:
    """The length of token shift ``i``'s carried inputs, for cost formulas (0, then its
    shift)."""
    return sympy.Symbol(f"u{i}", nonnegative=True, integer=True)


def _state_symbol(i: int) -> sympy.Symbol:
    """The length of scan ``i``'s carried state, for cost formulas (0, then 1)."""
    return sympy.Symbol(f"z{i}", nonnegative=True, integer=True)


def _recurrence_symbol(i: int) -> sympy.Symbol:
    """The length of recurrence ``i``'s carried state, for cost formulas (0, then 1)."""
    return sympy.Symbol(f"r{i}", nonnegative=True, integer=True)


def _scan_symbol(i: int) -> sympy.Symbol:
    """The length of carried scan ``i``'s value, for cost formulas (0, then 1)."""
    return sympy.Symbol(f"c{i}", nonnegative=True, integer=True)


def _carried_scans(gm: fx.GraphModule) -> list[CarriedScan]:
    """The live running products, log-sum-exps, maxima and minima along the sequence
    (``refuse_sequence_mixing`` proved each), in graph order."""
    live = live_nodes(gm)
    return [c for n in gm.graph.nodes if n in live and (c := carried_scan(n)) is not None]


def _continue_scan(g: fx.Graph, scan: CarriedScan, carry: fx.Node) -> fx.Node:
    """The scan runs over [carry; chunk] (the carry empty for the first chunk, the value at the
    previous chunk's last token after it) and its users read it without the carry's entry: the
    chunk's values, each computed from the one before exactly as the unchunked scan computes
    it. Returns the next chunk's carry: the value at this chunk's last token."""
    n, d = scan.node, scan.dim
    x = node_arg(n, 0)
    made = []

    def call(target, *args, **kwargs) -> fx.Node:
        made.append(g.call_function(target, args, kwargs))
        return made[-1]

    pair = isinstance(n.meta["val"], tuple)  # cummax, cummin: (values, positions)
    with g.inserting_before(n):
        # cat promotes x to the carry's dtype, as cumprod(x, dtype=...) would (x may be a node
        # this pass made, with no value yet: another scan's cut, a table's rows)
        n.replace_input_with(x, call(aten.cat.default, [carry, x], d))
        start = call(aten.sym_size.int, carry, d)
    values = (
        [u for u in n.users if u.target is operator.getitem and u.args[1] == 0] if pair else [n]
    )
    with g.inserting_after(n):
        whole = call(operator.getitem, n, 0) if pair else n
    with g.inserting_after(whole):
        cut = call(aten.slice.Tensor, whole, d, start, _END)
    for v in values:
        v.replace_all_uses_with(cut, delete_user_cb=lambda u: u not in (cut, whole))
    with g.inserting_after(cut):
        out = call(aten.slice.Tensor, whole, d, -1, _END)
    for m in made:
        m.meta[META_MODULE], m.meta[META_LAYER] = (
            n.meta.get(META_MODULE, ""),
            n.meta.get(META_LAYER),
        )
    return out


def _recurrences(gm: fx.GraphModule) -> list[Recurrence]:
    """The live linear scans along the sequence (``refuse_sequence_mixing`` proved each and
    recorded its sequence dim), in graph order."""
    live = live_nodes(gm)
    return [r for n in gm.graph.nodes if n in live and (r := recurrence(n)) is not None]


def _recur_from_state(g: fx.Graph, rec: Recurrence, carry: fx.Node) -> fx.Node:
    """The scan starts from the carry's last state (zeros for the first chunk, whose carry is
    empty). Returns the next chunk's carry: the state after this chunk's last token."""
    n, d = rec.node, rec.dim
    n.args = (*n.args[:3], carry)
    with g.inserting_after(n):
        out = g.call_function(aten.slice.Tensor, (n, d, -1, _END))
    out.meta[META_MODULE], out.meta[META_LAYER] = (
        n.meta.get(META_MODULE, ""),
        n.meta.get(META_LAYER),
    )
    return out


def _state_scans(gm: fx.GraphModule) -> list[StateScan]:
    """The live state scans (``refuse_sequence_mixing`` proved each), in graph order."""
    live = live_nodes(gm)
    return [
        scan
        for n in gm.graph.nodes
        if n in live and isinstance(scan := state_scan(n, live), StateScan)
    ]


def _scan_from_state(g: fx.Graph, scan: StateScan, carry: fx.Node) -> fx.Node:
    """The scan starts from the last block of [zeros; carry] (zeros for the first chunk, whose
    carry is empty; the state the previous chunk ended with after it) instead of its zeros.
    Returns the next chunk's carry: the state after this chunk's last block, ``out[:, -1:]``."""
    z, d = scan.zeros, scan.dim
    made = []

    def call(target, *args, **kwargs) -> fx.Node:
        made.append(g.call_function(target, args, kwargs))
        return made[-1]

    with g.inserting_before(scan.cat):
        history = call(aten.cat.default, [z, carry], d)
        start = call(aten.slice.Tensor, history, d, -1, _END)
    scan.cat.replace_input_with(z, start)
    with g.inserting_after(scan.einsum):
        out = call(aten.slice.Tensor, scan.einsum, scan.out_dim, -1, _END)
    for m in made:
        m.meta[META_MODULE], m.meta[META_LAYER] = (
            scan.einsum.meta.get(META_MODULE, ""),
            scan.einsum.meta.get(META_LAYER),
        )
    return out


def _token_shifts(gm: fx.GraphModule) -> list[TokenShift]:
    """The live token shifts along the sequence (``refuse_sequence_mixing`` proved each and
    recorded the sequence dim of its input), in graph order."""
    live = live_nodes(gm)
    out = []
    for n in gm.graph.nodes:
        shift = token_shift(n) if n in live else None
        seq = shift.x.meta.get(META_SEQ_DIM) if shift is not None else None
        if shift is not None and seq is not None and seq % shift.x.meta["val"].dim() == shift.dim:
            out.append(shift)
    return out


def _causal_convs(gm: fx.GraphModule) -> list[CausalConv]:
    """The live convolutions along the sequence (``refuse_sequence_mixing`` proved each causal
    and recorded the sequence dim of its input), in graph order; a kernel of 1 needs no carry."""
    live = live_nodes(gm)
    out = []
    for n in gm.graph.nodes:
        if n not in live or n.target not in CONVS:
            continue
        form = causal_conv(n, live)
        x = form.x if isinstance(form, CausalConv) else n.args[0]
        seq = x.meta.get(META_SEQ_DIM)
        nd = x.meta["val"].dim()
        batched = nd == n.args[1].meta["val"].dim()
        if seq is None or (batched and seq % nd == 0):
            continue  # not along the sequence (or the sequence is the conv's batch)
        if not isinstance(form, CausalConv) or seq % nd != form.dim:
            raise AutopartError(  # refuse_sequence_mixing would have refused it
                f"{n.name}: a convolution along the sequence not proven causal",
                hint="please report the model",
            )
        if form.window:
            out.append(form)
    return out


def _convolve_with_carry(g: fx.Graph, conv: CausalConv, carry: fx.Node) -> fx.Node:
    """The conv over [its window of earlier inputs; the chunk's], unpadded (``_after_carry``).
    Returns the next chunk's carry."""
    n = conv.conv
    # x as the graph has it now (an earlier rewrite may have replaced the one ``conv`` names)
    x = node_arg(conv.pad if conv.pad is not None else n, 0)
    joined, out = _after_carry(g, n, x, carry, conv.dim, conv.window)
    if conv.pad is not None:  # conv(pad(x)) → conv([window; x]) (each conv its own carry)
        n.replace_input_with(conv.pad, joined)
        if not conv.pad.users:
            g.erase_node(conv.pad)
    else:  # conv(x, padding=window)[..., :s] → conv([window; x], padding=0)[..., :s]
        n.replace_input_with(x, joined)
        _set_arg(n, "padding", [0])
    return out


def _shift_with_carry(g: fx.Graph, shift: TokenShift, carry: fx.Node) -> fx.Node:
    """pad(x, (…, p, −p)) → [window; x] without its last p entries (``_after_carry``): the
    chunk's inputs each moved p tokens later, the first p from before the chunk. Returns the
    next chunk's carry."""
    n, d, w = shift.node, shift.dim, shift.shift
    joined, out = _after_carry(g, n, node_arg(n, 0), carry, d, w)  # x as the graph has it now
    with g.inserting_before(n):
        moved = g.call_function(aten.slice.Tensor, (joined, d, 0, -w))
    moved.meta[META_MODULE], moved.meta[META_LAYER] = (
        n.meta.get(META_MODULE, ""),
        n.meta.get(META_LAYER),
    )
    n.replace_all_uses_with(moved)
    g.erase_node(n)
    return out


def _after_carry(
    g: fx.Graph, at: fx.Node, x: fx.Node, carry: fx.Node, d: int, w: int
) -> tuple[fx.Node, fx.Node]:
    """Before ``at``: [window; x] along ``d``, where the window is the last ``w`` entries of
    [zeros; carry] (the zeros for the first chunk, whose carry is empty; the previous chunk's
    last inputs after it), and the next chunk's carry, the last ``w`` entries of [window; x]
    (some of them the carry's when the chunk is shorter than ``w``)."""
    made = []

    def call(target, *args) -> fx.Node:
        made.append(g.call_function(target, args))
        return made[-1]

    with g.inserting_before(at):
        # zeros of the window's length (the carry's other sizes; a pad would pin its symbolic
        # sizes to numbers)
        size = [
            w if i == d else call(aten.sym_size.int, carry, i) if isinstance(k, torch.SymInt) else k
            for i, k in enumerate(carry.meta["val"].shape)
        ]
        zeros = call(aten.new_zeros.default, carry, size)
        history = call(aten.cat.default, [zeros, carry], d)
        window = call(aten.slice.Tensor, history, d, -w, _END)
        joined = call(aten.cat.default, [window, x], d)
        out = call(aten.slice.Tensor, joined, d, -w, _END)
    for m in made:
        m.meta[META_MODULE], m.meta[META_LAYER] = (
            at.meta.get(META_MODULE, ""),
            at.meta.get(META_LAYER),
        )
    return joined, out


_END = 9223372036854775807  # a slice to the end


def _set_arg(n: fx.Node, name: str, value) -> None:
    args = list(n.args)
    for i, arg in enumerate(cast(Any, n.target)._schema.arguments):
        if arg.name != name:
            continue
        if i < len(args):
            args[i] = value
            n.args = tuple(args)
        else:
            n.kwargs = {**n.kwargs, name: value}
        return


def _attend_with_prefix(
    g: fx.Graph,
    sdpa: fx.Node,
    kp: fx.Node,
    vp: fx.Node,
    keys: dict[str, fx.Node] | None = None,
    masks: dict[tuple[str, ...], fx.Node] | None = None,
    trim: bool = False,
) -> list[fx.Node]:
    """SDPA (or a general-form attention, ``_score_with_prefix``) over [prefix; chunk] keys with
    the lower-right causal mask (and, for a mask of the
    batch's, ``META_DATA_MASK``, its padding and documents from the key columns ``keys``, built
    once into ``masks``); returns (K, V) full, or with ``trim`` (a sliding window of W keys) their
    last W − 1 positions: all a later query sees of them."""
    if is_scored(sdpa):
        return _score_with_prefix(g, sdpa, kp, vp, trim)
    q, k, v = node_arg(sdpa, 0), node_arg(sdpa, 1), node_arg(sdpa, 2)
    dropout = float_arg(sdpa, 4, "dropout_p", 0.0)
    kwargs = {
        key: val
        for key, val in sdpa.kwargs.items()
        if key not in ("attn_mask", "dropout_p", "is_causal")
    }
    made: list[fx.Node] = []
    with g.inserting_before(sdpa):
        k_full = g.call_function(aten.cat.default, ([kp, k], -2))
        v_full = g.call_function(aten.cat.default, ([vp, v], -2))
        names = tuple(sdpa.meta.get(META_DATA_MASK) or ())
        if sdpa.meta.get(META_MASK_FN):  # a function of positions: its key length is Lk now
            mask = node_arg(sdpa, 3)
            _keys_from(g, mask, k, kp)
        elif names and masks is not None and names in masks:
            mask = masks[names]
        elif names:
            assert keys is not None and masks is not None, "a batch mask needs its key columns"
            mask = masks[names] = document_chunk_mask(g, q, k_full, {n: keys[n] for n in names})
        else:
            mask = lower_right_mask(g, q, k_full, sdpa.meta.get(META_WINDOW))
        new = g.call_function(SDPA, (q, k_full, v_full, mask, float(dropout), False), kwargs)
        kept = [k_full, v_full]
        if trim:
            last = 1 - int(sdpa.meta[META_WINDOW])  # -(W - 1)
            kept = [g.call_function(aten.slice.Tensor, (x, -2, last, _END)) for x in kept]
            made += kept
        outs = kept
    for n in (k_full, v_full, new, *made):
        n.meta[META_MODULE], n.meta[META_LAYER] = (
            sdpa.meta.get(META_MODULE, ""),
            sdpa.meta.get(META_LAYER),
        )
    new.meta[META_ATTENTION] = "causal, chunked"
    new.meta[META_WINDOW] = sdpa.meta.get(META_WINDOW)
    if META_RECOMPUTE in sdpa.meta:  # the attention core it replaces is recomputed
        new.meta[META_RECOMPUTE] = sdpa.meta[META_RECOMPUTE]
    old_mask = sdpa.args[3] if len(sdpa.args) > 3 and not sdpa.meta.get(META_MASK_FN) else None
    sdpa.replace_all_uses_with(new)
    g.erase_node(sdpa)
    if isinstance(old_mask, fx.Node):  # the unchunked window mask
        erase_unused(g, old_mask)
    return outs


def _qkv(n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """q, k, v of a canonical attention: an SDPA's first arguments, or a general form's."""
    return scored_qkv(n) if is_scored(n) else (node_arg(n, 0), node_arg(n, 1), node_arg(n, 2))


def _score_with_prefix(
    g: fx.Graph, pv: fx.Node, kp: fx.Node, vp: fx.Node, trim: bool = False
) -> list[fx.Node]:
    """A general-form attention over [prefix; chunk]: K joined to its prefix before kᵀ, V
    before the product with v, and the rebuilt terms' key lengths lengthened by the prefix's
    (the score function is elementwise, so the chunk's rows of it are the same function of
    the positions); returns (K, V) whole, or with ``trim`` (a sliding window of W keys,
    ``position_masks.score_window``: shifting positions changes nothing) their last W − 1
    positions."""
    q, k, v = scored_qkv(pv)
    group, stack = [], [node_arg(pv, 0)]
    while stack:  # the score function's nodes, back to q·kᵀ
        n = stack.pop()
        if n.meta.get(META_SCORES) in ("mod", "qk") and n not in group:
            group.append(n)
            stack.extend(n.all_input_nodes)
    qk = next(n for n in group if n.meta[META_SCORES] == "qk")
    kt = node_arg(qk, 1)  # kᵀ
    made: list[fx.Node] = []
    last = 1 - int(pv.meta[META_WINDOW]) if trim else 0  # -(W - 1): all a later query sees

    def handed_on(full: fx.Node) -> fx.Node:
        if trim:
            made.append(g.call_function(aten.slice.Tensor, (full, -2, last, _END)))
            full = made[-1]
        return full

    with g.inserting_before(kt):
        k_full = g.call_function(aten.cat.default, ([kp, k], -2))
        k_out = handed_on(k_full)
    with g.inserting_before(pv):
        v_full = g.call_function(aten.cat.default, ([vp, v], -2))
        v_out = handed_on(v_full)
    kt.replace_input_with(k, k_full)
    pv.replace_input_with(v, v_full)
    for m in group:
        for a in m.all_input_nodes:
            if a.meta.get(META_MASK_FN):
                _keys_from(g, a, k, kp)
    for m in (k_full, v_full, *made):
        m.meta[META_MODULE], m.meta[META_LAYER] = (
            pv.meta.get(META_MODULE, ""),
            pv.meta.get(META_LAYER),
        )
    pv.meta[META_ATTENTION] = "causal, chunked"
    return [k_out, v_out]


def _keys_from(g: fx.Graph, mask: fx.Node, k: fx.Node, kp: fx.Node) -> None:
    """Lengthen the key-length sizes of a rebuilt position mask (``position_masks.local_mask``)
    by the prefix's: its rows are then the chunk's queries over every key they see."""
    seen, stack, keys = set(), [mask], []
    while stack:
        n = stack.pop()
        if n in seen or not n.meta.get(META_MASK_FN):
            continue
        seen.add(n)
        if n.meta[META_MASK_FN] == "keys" and n.args[0] is k:
            keys.append(n)
        stack.extend(n.all_input_nodes)
    for n in keys:
        with g.inserting_after(n):
            p = g.call_function(aten.sym_size.int, (kp, -2))
        with g.inserting_after(p):
            total = g.call_function(operator.add, (p, n))
        for m in (p, total):
            m.meta.update({META_MASK_FN: True, META_MODULE: n.meta.get(META_MODULE, "")})
            m.meta[META_LAYER] = n.meta.get(META_LAYER)
        n.replace_all_uses_with(total, delete_user_cb=_other_than(total))


def _other_than(node: fx.Node):
    """A ``delete_user_cb`` keeping ``node`` itself on its input."""
    return lambda user: user is not node


def document_chunk_mask(g: fx.Graph, q: fx.Node, k: fx.Node, keys: dict[str, fx.Node]) -> fx.Node:
    """[b, 1, Lq, Lk] boolean: ``canonicalize_attention.document_mask``'s rows of the chunk's
    queries (the last Lq of the Lk key positions) over all Lk keys, built in the graph from the
    key columns ``keys`` of ``attention_mask`` (a key that is padding is masked) and
    ``position_ids`` (a key of another document is masked: documents start where the
    positions do not step up by 1, counted over the prefix's tokens and the chunk's)."""
    keep = lower_right_mask(g, q, k)  # [Lq, Lk]

    def call(op, *args):
        return g.call_function(op, args)

    if "attention_mask" in keys:
        valid = call(aten.ne.Scalar, keys["attention_mask"], 0)  # [b, Lk]
        valid = call(aten.unsqueeze.default, call(aten.unsqueeze.default, valid, 1), 1)
        keep = call(aten.bitwise_and.Tensor, keep, valid)  # [b, 1, Lq, Lk]
    if "position_ids" in keys:
        pos = keys["position_ids"]
        first = call(aten.sub.Tensor, call(aten.slice.Tensor, pos, 1, 0, 1), 1)
        steps = call(aten.diff.default, pos, 1, -1, first)
        doc = call(aten.cumsum.default, call(aten.ne.Scalar, steps, 1), -1)  # [b, Lk]
        lq = call(aten.sym_size.int, q, -2)
        lk = call(aten.sym_size.int, k, -2)
        mine = call(aten.slice.Tensor, doc, 1, call(operator.sub, lk, lq), lk)  # [b, Lq]
        rows = call(aten.unsqueeze.default, call(aten.unsqueeze.default, mine, 1), -1)
        cols = call(aten.unsqueeze.default, call(aten.unsqueeze.default, doc, 1), 1)
        keep = call(aten.bitwise_and.Tensor, keep, call(aten.eq.Tensor, rows, cols))
    return keep


__all__ = ["META_KV", "META_KV_SHAPES", "P", "chunk_stage", "lower_right_mask", "sequence_chunk"]
