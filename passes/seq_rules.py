"""Sequence rules for the Seq1F1B pass: which dim of each value carries the sequence, proven
op by op from an allow-list.

``prove(gm)`` walks a stage graph in order and gives every live node an abstract value:

- ``None``: the value does not depend on the sequence (parameters, buffers, constants, and what
  is computed from them alone); no dim of it grows with the sequence length;
- ``Seq(dim, inner)``: ``dim`` carries the sequence, token t's entries at index t (times
  ``inner``, the stride of the token index inside a dim merged with others, such as
  ``[b·s, h]`` or the ``[b·s·k]`` slots of k routed experts per token), and the value at
  token t depends only on tokens ≤ t through constructs the chunk pass knows how to chunk;
- ``LENGTH``: an integer that grows with the sequence length (``sym_size`` of the sequence dim,
  arithmetic on it): allowed only as a size (views, expands, factories, a whole slice);
- ``SUMMED``: a sum over every token (the loss): chunks' sums add up to the sequence's, so it
  may reach the output, plus or times values that do not depend on the sequence, and nothing
  else;
- routing values of a mixture of experts (``Routed``), below;
- ``PADDED`` / ``WINDOWED``: a causal convolution's input padded on the left, and the output
  of one padded on both sides, which only the convolution, and the cut back to the first s
  outputs, may read;
- ``Round(Q)``: a size computed from the length that is 0 at every multiple of Q (a scan's
  padding to whole blocks), allowed only as a pad at the end of the sequence; ``Seq.block``:
  the tokens laid out in blocks of Q, one block per index (a scan's ``[b, s/Q, Q, …]``);
  ``SCAN``: a value inside a recognized state scan (``StateScan``), read only by it.

The allow-list: position-wise ops (elementwise, reductions, norms and softmaxes over other
dims, matmuls contracting other dims, views and rearrangements that keep the token order,
slices and pads of other dims, embeddings and table reads at token-aligned indices),
positions (``arange(s)``, running counts of a constant: the chunk pass shifts them by the
chunk's offset), constants sized by the sequence, causal attention (``canonicalize_attention``
marked it; the chunk pass gives it its K/V prefix), causal convolutions along the sequence
(``causal_conv``: stride 1, zero-padded by their window (k − 1)·d on the left only, by a pad
or by symmetric padding cut back to the first s outputs; the chunk pass carries their window
of inputs from chunk to chunk), token shifts (``TokenShift``: a zero pad by p before the
sequence and −p after it, RWKV's time shift; the chunk pass carries the last p inputs), state scans over blocks of the sequence (``StateScan``:
Mamba-2's SSD; the chunk pass carries the state, chunks being whole blocks), the summed loss, and token routing (``sort`` of per-token
expert ids, the gather, grouped matmul and scatter back that a mixture of experts makes). Any
other op, and any op of the list acting along the sequence dim (a scan, a softmax or reduction
over it, any other convolution or pad along it, a product contracting or pairing it, an index
into it, a slice of it, the length used as a value) is a ``Mixes`` finding, naming what mixes
the tokens. No dim is guessed: a value's sequence dim is the one whose size grows
with the sequence (sizes are evaluated at several lengths), and the rule must agree.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import sympy
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import autopart.scan  # noqa: F401 - registers autopart::linear_scan
from autopart.frontend.capture import S, to_sympy
from autopart.meta import (
    META_ATTENTION,
    META_BUFFERS,
    META_INPUT,
    META_LOOPS,
    META_MASK_FN,
    META_SCORES,
    META_SEQ_DIM,
    META_SYMBOLS,
)
from autopart.node_args import int_arg, node_arg, seq_arg, whole_slice

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
LINEAR_SCAN = torch.ops.autopart.linear_scan.default
_SAMPLES = ((3, 48), (3, 96), (5, 96))  # (b, s) at which sizes are evaluated


@dataclass(frozen=True)
class Seq:
    """``dim`` carries the sequence; ``inner`` is the token index's stride inside that dim, at
    each of ``_SAMPLES`` (1 when the dim is the sequence itself)."""

    dim: int
    inner: tuple[int, ...]
    part: int = 1  # 1: the whole chunk; p: a tp rank's 1/p of it (sequence parallelism)
    block: int = 1  # tokens per index: a scan's blocks of Q consecutive tokens (``_view``)
    # the same at every index (a constant sized by the batch, ``rows_mixed`` only): any layout
    const: bool = False


@dataclass(frozen=True)
class Routed:
    """Token routing of a mixture of experts, tied to its ``sort`` node ``key``: ``rows`` (the
    tokens' rows in the sorted order), ``perm`` (the sort's indices), ``inverse`` (the inverse
    permutation), ``counts`` / ``offsets`` (tokens per expert, their running sum), ``count``
    (expert ``index[0]``'s count as a number) and ``piece`` (expert ``index[1]``'s group of
    rows, cut from the rows by split node ``index[0]``)."""

    kind: str
    key: fx.Node
    seq: Seq  # the alignment of the sorted (slot) dim before sorting
    index: tuple[Any, ...] = ()


LENGTH, SUMMED, MIXED, SLOTS = "length", "summed", "mixed", "slots"
# a causal convolution's input padded on the left by its window (read only by such convs), and
# the output of one padded on both sides (read only by slices keeping its first s outputs)
PADDED, WINDOWED = "padded", "windowed"


@dataclass(frozen=True)
class Round:
    """A size that is 0 whenever the length is a multiple of ``block`` (a scan's padding to
    whole blocks, ``(Q − s mod Q) mod Q``): with chunks cut at multiples of Q, a pad by it at
    the end of the sequence adds nothing to any chunk but the last, and to the last what it adds
    to the whole sequence."""

    block: int


SCAN = "scan"  # a value inside a recognized state scan (``StateScan``), read only by the scan


class Mixes(Exception):
    """The node mixes tokens along the sequence (the message says how)."""

    def sentence(self) -> str:
        return f"{self} mixes tokens of different chunks"


class Fixed(Mixes):
    """The graph runs at one sequence length only: there is nothing to chunk."""

    def sentence(self) -> str:
        return str(self)


class Unproven(Mixes):
    """No rule covers the op: nothing proves it keeps tokens apart."""

    def sentence(self) -> str:
        return f"{self} has no sequence rule (nothing proves it keeps the chunks' tokens apart)"


ONE = (1,) * len(_SAMPLES)


def seq_dims(gm: fx.GraphModule) -> tuple[dict[fx.Node, Any], list[tuple[fx.Node, str]], int]:
    """Every live node's abstract value, the nodes that mix tokens (each with how), and the
    multiple every chunk length must be (a scan's block Q, else 1). Sizes are evaluated at
    lengths that are multiples of Q (the proof is redone at such lengths when the first found
    a Q that the default ones are not multiples of)."""
    p = _Prover(gm)
    env, found = p.run()
    if any(s % p.block for _, s in p.samples):
        scale = p.block // math.gcd(p.block, *(s for _, s in _SAMPLES))
        p = _Prover(gm, tuple((b, s * scale) for b, s in _SAMPLES))
        env, found = p.run()
    return env, found, p.block


class _Prover:
    def __init__(
        self,
        gm: fx.GraphModule,
        samples: tuple[tuple[int, int], ...] = _SAMPLES,
        rows: bool = False,
    ) -> None:
        self.gm = gm
        self.rows = rows  # the batch in the sequence's place (``rows_mixed``)
        self.samples = samples  # (b, s): multiples of every scan block (``seq_dims``)
        self.block = 1  # chunks must be multiples of this: the scans' blocks (``_round_pad``)
        self.scans: dict[fx.Node, tuple[str, StateScan]] = {}  # node → its role in a scan
        self.env: dict[fx.Node, Any] = {}
        self.found: list[tuple[fx.Node, str]] = []
        self._memo: dict[Any, tuple[int, ...]] = {}
        self.names = gm.meta.get(META_SYMBOLS, {})

    # -- sizes at the sample lengths ------------------------------------------------------------
    def at(self, x: Any) -> tuple[int, ...]:
        """An int or SymInt at each sample (b, s); other symbols are set to 4."""
        if not isinstance(x, torch.SymInt):
            return (int(x),) * len(_SAMPLES)
        key = x.node.expr
        if key not in self._memo:
            expr = to_sympy(x, self.gm)
            b = next((v for v in self.names.values() if v.name == "b"), None)
            others = {sym: 4 for sym in expr.free_symbols - {S, b}}
            self._memo[key] = tuple(
                int(expr.xreplace({**others, S: s, **({b: bb} if b is not None else {})}))
                for bb, s in self.samples
            )
        return self._memo[key]

    def part(self, x: Any) -> int | None:
        """p when the size ``x`` is s / p at every sample (the whole sequence: 1; a tp rank's
        share under sequence parallelism: tp), else None."""
        parts = {
            s // v if v and s % v == 0 else 0
            for v, (_, s) in zip(self.at(x), self.samples, strict=True)
        }
        return None if len(parts) != 1 or 0 in parts else parts.pop()

    def grows(self, x: Any) -> bool:
        v = self.at(x)
        return v[0] != v[1]

    def growing(self, val: Any) -> list[int]:
        return [d for d, x in enumerate(val.shape) if self.grows(x)] if _is_tensor(val) else []

    # -- the walk -------------------------------------------------------------------------------
    def run(self) -> tuple[dict[fx.Node, Any], list[tuple[fx.Node, str]]]:
        live = self.live = _ancestors(self.gm) if self.rows else live_nodes(self.gm)
        for n in self.gm.graph.nodes:
            if self.rows:
                break  # no construct carries anything from row to row
            if n in live and isinstance(scan := state_scan(n, live), StateScan):
                self.scans.update({m: (role, scan) for role, ms in scan.roles() for m in ms})
        for n in self.gm.graph.nodes:
            if n not in live:
                continue
            try:
                if n.op == "placeholder":
                    value = self.placeholder(n)
                elif n.op == "output":
                    self.output(n)
                    continue
                elif any(self.env.get(a) is MIXED for a in n.all_input_nodes):
                    value = MIXED
                    if _is_softmax(n) and self._softmax_along(n):  # name the attention, below
                        raise Mixes(SOFTMAX)
                else:
                    value = self.check(n, self.call(n))
            except Mixes as exc:
                self.found.append((n, exc.sentence()))
                value = MIXED
            self.env[n] = value
        # a scan-like product (an einsum of concatenated states) that was not recognized: name
        # why first, when its concatenation is what mixed
        missed = [
            (n, f"a state scan autopart does not chunk ({why}) mixes tokens of different chunks")
            for n in self.gm.graph.nodes
            if n in live
            and n not in self.scans
            and any(self.env.get(x) is MIXED for x in _scan_states(n))
            and isinstance(why := state_scan(n, live), str)
        ]
        return self.env, missed + self.found

    def placeholder(self, n: fx.Node) -> Any:
        ref = n.meta.get(META_INPUT)
        val: Any = n.meta.get("val")  # a tensor, a SymInt or absent
        grow = self.growing(val)
        if not grow and getattr(ref, "kind", None) == "data" and _is_tensor(val) and self.rows:
            raise Fixed(f"the batch size of {n.name} was fixed at capture to {val.shape[0]}")
        if not grow and getattr(ref, "kind", None) == "data" and _is_tensor(val):
            loops = self.gm.meta.get(META_LOOPS)
            raise Fixed(
                f"the sequence length of {n.name} was fixed at capture to {val.shape[-1]} "
                "tokens (torch.export specialized it): the graph runs at that length only, "
                "never on a chunk"
                + (
                    " (export fixes it for a loop over the tokens or a Python number computed "
                    "from the length, such as math.log(seq_len), and autopart could not write "
                    f"the graph for any length: {loops})"
                    if loops
                    else ""
                )
            )
        if not grow:
            return LENGTH if isinstance(val, torch.SymInt) and self.grows(val) else None
        if getattr(ref, "kind", None) not in ("data", "act") or len(grow) > 1:
            raise Mixes(f"an input ({getattr(ref, 'kind', '?')}) sized by the sequence")
        part = self.part(val.shape[grow[0]])
        if part is None:
            raise Mixes("a stage input whose sequence dim is merged with another dim")
        return Seq(grow[0], ONE, part)

    def output(self, n: fx.Node) -> None:
        for a in _flat(n.args[0]):
            if isinstance(a, fx.Node) and self.env.get(a) is LENGTH:
                self.found.append((a, Mixes("the sequence length returned").sentence()))

    def check(self, n: fx.Node, value: Any) -> Any:
        """The rule's answer must agree with the sizes: a ``Seq`` dim grows, nothing else does."""
        vals: Any = n.meta.get("val")
        if isinstance(value, tuple):
            for v, x in zip(value, vals, strict=False):
                self._agree(v, x)
        else:
            self._agree(value, vals)
        return value

    def _agree(self, value: Any, val: Any) -> None:
        if not _is_tensor(val) or value in (SLOTS, PADDED, WINDOWED, SCAN):
            return
        if _rows(value) and free_unbacked_symbols(val.shape[value.seq.dim]):
            return  # the experts' groups joined: counted from the data (JetMoE), summing to b·s·k
        grow = self.growing(val)
        if len(grow) > 1:
            raise Mixes("a value pairing tokens with tokens (two dims sized by the sequence)")
        want = (
            value.dim
            if isinstance(value, (Seq, RowIndex))
            else value.seq.dim
            if _rows(value)
            else None
        )
        if value is SUMMED or (isinstance(value, Routed) and not _rows(value)):
            want = grow[0] if grow else None
        if grow != ([] if want is None else [want % max(val.dim(), 1)]):
            raise Mixes(
                "a value sized by the sequence but not laid out along it"
                if grow
                else "a reduction of the sequence dim"
            )

    # -- rules ------------------------------------------------------------------------------
    def call(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            raise Mixes(f"a {n.op} node")
        target = n.target
        if n in self.scans:
            return _scan_part(self, n)
        if any(self.env.get(a) is SCAN for a in n.all_input_nodes):
            raise Mixes("a value inside a state scan read other than by the scan")
        if self._free(n):
            return None  # weights and constants only: no token to keep apart
        if target in _SYM_OPS or target is operator.getitem and not _is_tensor_list(n.args[0]):
            if target is operator.getitem:
                src = self.env.get(node_arg(n, 0))
                return src[int_arg(n, 1)] if isinstance(src, tuple) else src
            val = n.meta.get("val")
            if any(self._length(a) or isinstance(self.env.get(a), Round) for a in _flat(n.args)):
                q = _round_block(val, self.gm)  # checked at multiples of Q, not at the samples
                return Round(q) if q is not None else LENGTH
            return LENGTH if isinstance(val, torch.SymInt) and self.grows(val) else None
        if any(isinstance(self.env.get(a), Round) for a in n.all_input_nodes):
            if target not in _PADS:
                raise Mixes("the sequence length used as a value (each chunk has its own)")
            return _round_pad(self, n)
        if any(
            isinstance(v := self.env.get(a), Seq) and v.block > 1 for a in n.all_input_nodes
        ) and (
            (target in _SPECIAL and target not in _BLOCK_RULES)
            or target in _ROUTING_ENTRY
            or is_scored(n)
        ):
            raise Mixes(f"{_op_name(target)} of a scan's blocks of the sequence")
        if target is operator.getitem:
            src = self.env.get(node_arg(n, 0))
            return src[int_arg(n, 1)] if isinstance(src, tuple) else src
        if self.rows and any(isinstance(self.env.get(a), RowIndex) for a in n.all_input_nodes):
            return _row_index(self, n)
        if self.rows and target in _ROWS and not self._routing(n):
            return _ROWS[target](self, n)
        if is_scored(n):  # a general-form attention: its q, k, v only (live_nodes)
            return _attention(self, n)
        if self.rows:
            pass  # positions and tables are read the same on every rank's rows
        elif target == aten.slice.Tensor and (d := _position_slice(n, self.gm)) is not None:
            return Seq(d, ONE)  # positions read from a buffer: shifted by the chunk's offset
        elif target == aten.slice.Tensor and (d := table_rows(n, self.gm)) is not None:
            return Seq(d, ONE)  # a table's rows at the positions: read from the chunk's offset
        self._no_length(n)
        if target not in CONVS and any(
            self.env.get(a) in (PADDED, WINDOWED) for a in n.all_input_nodes
        ):
            return _window_user(self, n)
        if any(self.env.get(a) is SUMMED for a in n.all_input_nodes):
            return self._summed(n)
        routed = [self.env[a] for a in n.all_input_nodes if isinstance(self.env.get(a), Routed)]
        if any(self.env.get(a) is SLOTS for a in n.all_input_nodes):
            if not routed:
                raise Mixes(ARANGE)
            routed = [*routed, *(Routed("slots", routed[0].key, routed[0].seq),)]
        if routed or target in _ROUTING_ENTRY and self._routing_entry(n):
            return _route(self, n, routed)
        if target == aten.sum.dim_IntList and (counts := _one_hot_counts(self, n)) is not None:
            return counts
        if target in _SPECIAL:
            return _SPECIAL[target](self, n)
        if (
            getattr(target, "namespace", None) == "autopart"
            and getattr(target, "_opname", None) == "vocab_parallel_ce"
        ):
            return _loss(self, n)  # the summed cross entropy of vocabulary-split logits
        along = _ALONG.get(target)
        if along is None and self.rows and getattr(target, "namespace", "aten") not in _OURS:
            along = _nothing  # a library's op the plan trusts (docs/passes.md: rows)
        if along is None:
            if (
                target in _POINTWISE
                or torch.Tag.pointwise in getattr(target, "tags", ())
                or (
                    getattr(target, "namespace", None) == "autopart"
                    and getattr(target, "_opname", None) in _AUTOPART_LOCAL
                )
            ):
                along = _nothing
            else:
                raise Unproven(_op_name(target))
        for x, dims, what in along(n):
            v = self.env.get(x)
            if isinstance(v, Seq) and v.dim % _ndim(x) in {d % _ndim(x) for d in dims}:
                raise Mixes(what)
        return self._carry(n)

    def _carry(self, n: fx.Node, inner: tuple[int, ...] | None = None) -> Any:
        """The output's sequence dim (the one that grows), with the inputs' token stride."""
        seqs = [self.env[a] for a in n.all_input_nodes if isinstance(self.env.get(a), Seq)]
        varying = [s for s in seqs if not s.const]
        const = bool(seqs) and not varying
        seqs = varying or seqs  # a constant's layout is any: the others' decide
        inners = {s.inner for s in seqs}
        if len(inners) > 1:
            raise Mixes("tokens laid out with different strides combined")
        blocks = {s.block for s in seqs}
        if len(blocks) > 1:
            raise Mixes("tokens combined with a scan's blocks of them")
        block = next(iter(blocks), 1)
        parts = {s.part for s in seqs}
        if len(parts) > 1:
            raise Mixes("the whole chunk combined with a tp rank's share of it")
        inner = inner or next(iter(inners), ONE)
        part = next(iter(parts), 1)
        opname = getattr(n.target, "_opname", None)
        if getattr(n.target, "namespace", None) == "autopart" and opname in _SHARING:
            x, dim, size = node_arg(n, 0), int_arg(n, 1), int_arg(n, 3)  # (x, dim, group, size)
            if seqs and self.env[x].dim % _ndim(x) == dim % _ndim(x):  # split or joined along s
                part = part * size if opname in _SPLITTING else part // size
        vals = n.meta.get("val")
        if isinstance(vals, (tuple, list)):
            return tuple(self._one(v, inner, bool(seqs), part, block, const) for v in vals)
        return self._one(vals, inner, bool(seqs), part, block, const)

    def _one(
        self,
        val: Any,
        inner: tuple[int, ...],
        from_seq: bool,
        part: int = 1,
        block: int = 1,
        const: bool = False,
    ) -> Any:
        grow = self.growing(val)
        if not grow:
            if from_seq and _is_tensor(val):
                raise Mixes("a reduction of the sequence dim")
            return None
        if len(grow) > 1:
            raise Mixes("a value pairing tokens with tokens (two dims sized by the sequence)")
        if not from_seq:
            raise Mixes("a value sized by the sequence computed from no token")
        return Seq(grow[0], inner, part, block, const)

    def _free(self, n: fx.Node) -> bool:
        """``n`` computes from values free of the sequence only (a weight's transpose, as
        Falcon's ``numpy_T`` of its fused QKV weight, which was refused as having no sequence
        rule), with no size argument and no output dim that grows with the sequence."""
        if any(self.env.get(a) is not None for a in n.all_input_nodes):
            return False
        if any(isinstance(x, torch.SymInt) for x in _flat([*n.args, *n.kwargs.values()])):
            return False
        val = n.meta.get("val")
        return not any(self.growing(v) for v in (val if isinstance(val, (list, tuple)) else [val]))

    def _length(self, a: Any) -> bool:
        return (isinstance(a, fx.Node) and self.env.get(a) is LENGTH) or (
            isinstance(a, torch.SymInt) and self.grows(a)
        )

    def _no_length(self, n: fx.Node) -> None:
        """The sequence length is a size here, never a value."""
        sizes = SIZE_ARGS.get(n.target, ())
        for i, a in enumerate([*n.args, *n.kwargs.values()]):
            if i in sizes or (i >= len(n.args) and list(n.kwargs)[i - len(n.args)] in _SIZE_KW):
                continue
            if any(self._length(x) for x in _flat([a])):
                raise Mixes("the sequence length used as a value (each chunk has its own)")

    def _softmax_along(self, n: fx.Node) -> bool:
        val = node_arg(n, 0).meta.get("val")
        return _is_tensor(val) and self.grows(val.shape[int_arg(n, 1) % val.dim()])

    def _summed(self, n: fx.Node) -> Any:
        """A sum over the tokens plus or times values free of the sequence."""
        others = [self.env.get(a) for a in n.all_input_nodes if self.env.get(a) is not SUMMED]
        scaled = n.target not in (aten.mul.Tensor, aten.div.Tensor) or len(others) <= 1
        if n.target in _LINEAR_ON_SUMS and all(v is None for v in others) and scaled:
            return SUMMED
        raise Mixes(
            "a sum over the tokens (the loss, or a count of tokens) used other than added or "
            "scaled: each chunk would see only its own part of the sum"
        )

    def _routing(self, n: fx.Node) -> bool:
        """``n`` reads a value of token routing (the routing rule answers for it)."""
        return any(
            isinstance(v := self.env.get(a), Routed) or v is SLOTS for a in n.all_input_nodes
        )

    def _routing_entry(self, n: fx.Node) -> bool:
        v = self.env.get(node_arg(n, 0))
        if n.target in _PICKS:  # the tokens a per-token mask picks
            return isinstance(v, Seq) and _ndim(n.args[0]) == 1 and v.dim % 1 == 0
        return isinstance(v, Seq) and v.dim % _ndim(n.args[0]) == _dim_arg(n, 1, -1) % _ndim(
            n.args[0]
        )


# -- the routed experts of a mixture of experts ---------------------------------------------------


def _route(p: _Prover, n: fx.Node, routed: list[Routed]) -> Any:
    """HF's experts (``integrations/moe.py``): ``sort`` the slots' expert ids (slot j = token
    j // k's j % k-th choice), gather each slot's token row (``x[perm // k]``) and routing weight
    (``w[perm]``), count the slots per expert (``histc`` of the sorted ids, ``cumsum``: the group
    offsets), multiply each expert's group of rows by its weights (a grouped matmul, or capture's
    ATen form of one: every row by each expert's weights, kept where the row's slot index lies in
    that expert's group), and scatter the rows back (``out[inverse]``, ``inverse`` made by
    ``index_put(empty, [perm], arange)``). Each slot's result depends on its own token only."""
    t = n.target
    if t == aten.sort.default and not routed:
        key = p.env[node_arg(n, 0)]
        return (Routed("rows", n, key), Routed("perm", n, key))
    if t in _PICKS and not routed:  # the tokens one expert takes (a per-token mask's nonzero)
        picked = Routed("picked", n, p.env[node_arg(n, 0)])
        return (picked,) if t == aten.nonzero_numpy.default else picked
    if len({r.key for r in routed}) != 1:
        raise Mixes("token routing of two different sorts combined")
    r0 = routed[0]
    kinds = {r.kind for r in routed}
    env = [p.env.get(a) for a in n.all_input_nodes]
    others = [v for v in env if not isinstance(v, Routed) and v is not SLOTS]
    local = kinds <= {"rows", "group"} and "rows" in kinds or kinds == {"group"}
    if local and all(v is None for v in others) and _row_wise(n, p):
        return Routed("group", r0.key, r0.seq) if kinds == {"group"} else _rows_of(r0)
    one_piece = kinds == {"piece"} and len({r.index for r in routed}) == 1
    if one_piece and all(v is None for v in others) and _row_wise(n, p):
        return r0  # one expert's rows: row by row, that expert's weights
    if (by_counts := _split_by_counts(p, n, routed)) is not None:
        return by_counts
    if t == aten.cat.default and kinds == {"piece"} and _dim_arg(n, 1, 0) == 0:
        pieces = [p.env.get(a) for a in seq_arg(n, 0)]
        split = r0.index[0]
        order = [getattr(v, "index", None) for v in pieces]
        if order == [(split, i) for i in range(len(split.meta["val"]))]:  # every expert, in order
            return _rows_of(r0)
    if t == aten.unbind.int and kinds == {"counts"} and _dim_arg(n, 1, 0) == 0:
        return tuple(Routed("count", r0.key, r0.seq, (i,)) for i in range(len(n.meta["val"])))
    if t == aten.item.default and kinds == {"count"}:
        return r0
    # slot j of k choices per token belongs to token j // k: the key's token stride is k
    k = n.args[1] if len(n.args) > 1 else None
    floor = t == aten.floor_divide.default or (
        t == aten.div.Tensor_mode and n.kwargs.get("rounding_mode") in ("floor", "trunc")
    )  # of the sort's indices, which are not negative: floor and trunc agree
    # the slots' stride is k times the tokens' (1 along the sequence; a row's s tokens when
    # the batch is in its place, ``rows_mixed``)
    if kinds == {"perm"} and floor and isinstance(k, int) and k > 0 and _strided(r0, k):
        return Routed("token", r0.key, r0.seq, (k,))
    if kinds == {"picked"} and _picked_view(n):
        return r0
    if t == aten.index_add.default and _dim_arg(n, 1, 0) == 0 and len(n.args) == 4:
        out, idx, rows = (p.env.get(node_arg(n, i)) for i in (0, 2, 3))
        if (
            isinstance(idx, Routed)
            and idx.kind == "picked"
            and _rows(rows)
            and rows.key is idx.key
            and _laid_as(out, idx.seq)
        ):
            return idx.seq  # each picked token's row added back to that token
        fresh = node_arg(n, 0).target in (aten.zeros.default, aten.zeros_like.default)
        if fresh and _rows(rows) and isinstance(idx, Routed) and idx.key is rows.key:
            # each sorted row added back where it came from: its token (JetMoE's experts'
            # outputs, k per token, summed) or its slot (its attention heads' queries), into
            # zeros with exactly one row per token (per slot)
            size = p.at(node_arg(n, 0).meta["val"].shape[0])
            slots = p.at(node_arg(idx.key, 0).meta["val"].shape[0])
            if isinstance(out, Seq) and out.dim == 0:
                tokens = tuple(s // idx.index[0] for s in slots) if idx.index else ()
                token = idx.kind == "token" and size == tokens
                if token and (out.const or out == _token_seq(idx)):  # a constant's: any layout
                    return _token_seq(idx)
                if idx.kind == "perm" and size == slots:
                    return idx.seq
    if kinds == {"slots", "offsets"} and t in _COMPARE and others == []:
        return Routed("group", r0.key, r0.seq)
    if t == aten.index.Tensor and len(seq_arg(n, 1)) == 1:
        idx, x = p.env.get(seq_arg(n, 1)[0]), p.env.get(node_arg(n, 0))
        if isinstance(idx, Routed) and idx.kind == "token" and x == _token_seq(idx):
            return Routed("rows", idx.key, idx.seq)
        if isinstance(idx, Routed) and idx.kind == "perm" and x == idx.seq and x.dim == 0:
            return Routed("rows", idx.key, idx.seq)
        if isinstance(idx, Routed) and idx.kind == "inverse" and _rows(x) and x.key is idx.key:
            return idx.seq
        if isinstance(idx, Routed) and idx.kind == "picked" and _laid_as(x, idx.seq):
            return Routed("rows", idx.key, idx.seq)  # the picked tokens' rows
        if _rows(idx) and x is None:  # a table read per row (gpt-oss's per-expert biases)
            return _rows_of(idx)
    if t == aten.histc.default and kinds == {"rows"} and n.args[0] in _sorted_values(r0.key):
        return Routed("counts", r0.key, r0.seq)
    if t == aten.cumsum.default and kinds == {"counts"}:
        return Routed("offsets", r0.key, r0.seq)
    if t in (aten.select.int, aten.slice.Tensor) and kinds == {"offsets"}:
        return r0
    if t == aten.empty_like.default and kinds == {"perm"}:
        return Routed("empty", r0.key, r0.seq)
    if (
        t == aten.index_put.default
        and [p.env.get(a) for a in (node_arg(n, 0), *seq_arg(n, 1))]
        == [
            Routed("empty", r0.key, r0.seq),
            Routed("perm", r0.key, r0.seq),
        ]
        and p.env.get(node_arg(n, 2)) is SLOTS
    ):
        return Routed("inverse", r0.key, r0.seq)
    if _is_grouped_mm(t) and kinds == {"rows", "offsets"}:
        x, w, offs = (node_arg(n, i) for i in range(3))
        if _rows(p.env.get(x)) and p.env.get(w) is None and p.env[offs].kind == "offsets":
            return _rows_of(r0)
    raise Mixes(
        f"{_op_name(t)} on tokens reordered by a routing (a sort or a nonzero) along the "
        "sequence, which mixes positions; the only reordering proven is a routing of tokens to "
        "experts that puts each token back in its place"
    )


def _picked_view(n: fx.Node) -> bool:
    """The picked tokens' indices reshaped to one dim (``nonzero()[:, 0]``, ``.squeeze(-1)``,
    ``.view(-1)``)."""
    val = n.meta.get("val")
    if not _is_tensor(val) or val.dim() != 1 or len(n.all_input_nodes) != 1:
        return False
    if n.target == aten.select.int:
        return _dim_arg(n, 1, 0) % 2 == 1
    return n.target in (
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
    )


def _laid_as(v: Any, seq: Seq) -> bool:
    """``v`` holds one row per token laid out as ``seq`` (a constant: any layout)."""
    return (
        isinstance(v, Seq)
        and v.dim == seq.dim
        and (v.const or (v.inner, v.part, v.block) == (seq.inner, seq.part, seq.block))
    )


def _strided(r: Routed, k: int) -> bool:
    return all(i % k == 0 for i in r.seq.inner)


def _token_seq(token: Routed) -> Seq:
    """The layout of the tokens a "token" routing value indexes: dim 0, the slots' stride over
    the k slots per token (``Routed.index``: (k,))."""
    k = token.index[0]
    return Seq(0, tuple(i // k for i in token.seq.inner))


def _rows_of(r: Routed) -> Routed:
    return Routed("rows", r.key, r.seq)


def _one_hot_counts(p: _Prover, n: fx.Node) -> Routed | None:
    """``sum(one_hot(ids), 0)``, ``one_hot(ids)`` being ``scatter(zeros[t, E], 1, ids, 1)`` of
    the expert ids a ``topk`` chose per token and ``sort`` sorting them flattened (JetMoE): the
    slots per expert, as ``histc`` of the sorted ids counts them (``_route``)."""
    x = node_arg(n, 0)
    while x.target in (aten._to_copy.default, aten.to.dtype):
        x = node_arg(x, 0)
    if x.target != aten.scatter.value or x.args[1:2] != (1,) or x.args[3:] != (1,):
        return None
    zeros, ids = node_arg(x, 0), node_arg(x, 2)
    v = p.env.get(ids)
    chosen = ids.target is operator.getitem and node_arg(ids, 0).target == aten.topk.default
    if not (chosen and ids.args[1] == 1 and zeros.target == aten.zeros.default):
        return None
    if not (isinstance(v, Seq) and v.dim == 0 and _ndim(ids) == 2 and _dims_arg(n, 1) == [0]):
        return None
    k = ids.meta["val"].shape[1]
    flat = [u for u in ids.users if u.target in (aten.flatten.using_ints, aten.view.default)]
    sorts = [u for f in flat for u in f.users if u.target == aten.sort.default]
    if len(sorts) != 1 or not isinstance(k, int) or len(n.meta["val"].shape) != 1:
        return None
    if _ndim(node_arg(sorts[0], 0)) != 1:
        return None
    return Routed("counts", sorts[0], Seq(0, tuple(k * i for i in v.inner), v.part))


def _split_by_counts(p: _Prover, n: fx.Node, routed: list[Routed]) -> tuple | None:
    """``split_with_sizes(rows, [count_0, …, count_{E−1}])``: the rows cut into each expert's
    group by the counts of the same sort (JetMoE)."""
    if n.target != aten.split_with_sizes.default or _dim_arg(n, 2, 0) != 0:
        return None
    rows, sizes = p.env.get(node_arg(n, 0)), [p.env.get(a) for a in seq_arg(n, 1)]
    if not _rows(rows) or len({r.key for r in routed}) != 1:
        return None
    if sizes != [Routed("count", rows.key, rows.seq, (i,)) for i in range(len(sizes))]:
        return None
    return tuple(Routed("piece", rows.key, rows.seq, (n, i)) for i in range(len(sizes)))


def _row_wise(n: fx.Node, p: _Prover) -> bool:
    """An op on the rows that keeps each row to itself: elementwise, a matmul by weights free of
    the sequence, a view, split or slice keeping the row dim, or choosing between two rows' values."""
    t = n.target
    if t in _POINTWISE or torch.Tag.pointwise in getattr(t, "tags", ()):
        return True
    if t in (aten.mm.default, aten.matmul.default, aten.linear.default):
        rows = p.env.get(node_arg(n, 0))  # rows @ w
        rowlike = isinstance(rows, Routed) and rows.kind in ("rows", "piece")
        weights = [a for a in n.all_input_nodes if a is not node_arg(n, 0)]
        return rowlike and all(p.env.get(a) is None for a in weights)
    if t in (aten.view.default, aten.reshape.default, aten.unsqueeze.default):
        return str(n.meta["val"].shape[0]) == str(node_arg(n, 0).meta["val"].shape[0])
    if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return _dim_arg(n, 2, 0) % _ndim(n.args[0]) != 0
    if t in (aten.slice.Tensor, aten.select.int, aten.narrow.default):  # of another dim
        return _dim_arg(n, 1, 0) % _ndim(n.args[0]) != 0 or whole_slice(n)
    return False


_SLOT_USERS = frozenset(
    {
        aten.index_put.default,
        aten.ge.Tensor,
        aten.lt.Tensor,
        aten.le.Tensor,
        aten.gt.Tensor,
    }
)
_COMPARE = frozenset({aten.ge.Tensor, aten.gt.Tensor, aten.le.Tensor, aten.lt.Tensor})


def _sorted_values(sort: fx.Node) -> set[fx.Node]:
    """``sort``'s values and their casts (what ``histc`` may count)."""
    out = {u for u in sort.users if u.target is operator.getitem and u.args[1] == 0}
    for v in list(out):
        out |= {u for u in v.users if u.target in (aten._to_copy.default, aten.to.dtype)}
    return out


def _is_grouped_mm(t: Any) -> bool:
    return t in (aten._grouped_mm.default,) or getattr(t, "__name__", "").startswith(
        "grouped_mm_fallback"
    )


# -- tables ------------------------------------------------------------------------------------


def _nothing(n: fx.Node) -> list:
    return []


def _dim_arg(n: fx.Node, i: int, default: Any, key: str = "dim") -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(key, default)


def _dims_arg(n: fx.Node, i: int, key: str = "dim") -> list[int]:
    dims = _dim_arg(n, i, None, key)
    if dims is None or dims == []:
        return list(range(_ndim(n.args[0])))
    return list(dims) if isinstance(dims, (list, tuple)) else [dims]


def _along(what: str, pick: Callable[[fx.Node], list[int]], arg: int = 0) -> Callable:
    return lambda n: [(n.args[arg], pick(n), what)]


SOFTMAX = (
    "a softmax over the sequence that is not a recognized causal attention (its scores are "
    "not q·kᵀ from a product canonicalize_attention knows, or a key's weight depends on more "
    "than the positions)"
)
_REDUCE = "a reduction over the sequence"


def _reduction(n: fx.Node) -> list:
    return [(n.args[0], _dims_arg(n, 1), _REDUCE)]


def _vector_norm(n: fx.Node) -> list:
    """``linalg_vector_norm(x, ord, dim, keepdim)``: its dims come after the order."""
    return [(n.args[0], _dims_arg(n, 2), _REDUCE)]


def _scan(name: str) -> Callable:
    return _along(f"a {name} along the sequence", lambda n: [_dim_arg(n, 1, 0)])


def _slice(n: fx.Node) -> list:
    x = node_arg(n, 0)
    dim = _dim_arg(n, 1, 0)
    whole = whole_slice(n)
    return [] if whole else [(x, [dim], "a slice of the sequence")]


def _pad(n: fx.Node) -> list:
    pad = seq_arg(n, 1)
    nd = _ndim(n.args[0])
    dims = [nd - 1 - i // 2 for i, p in enumerate(pad) if not (isinstance(p, int) and p == 0)]
    return [(n.args[0], dims, "a pad along the sequence (a convolution's window, say)")]


def _contract(a_dim: int, b_dims: Callable[[fx.Node], list[int]], a: int = 0, b: int = 1):
    what = "a product summing over the sequence outside causal attention"

    def rule(n: fx.Node) -> list:
        return [(n.args[a], [a_dim], what), (n.args[b], b_dims(n), what)]

    return rule


def _matmul_b(n: fx.Node) -> list[int]:
    return [-2] if _ndim(n.args[1]) >= 2 else [0]


def _index(n: fx.Node) -> list:
    dims = [i for i, x in enumerate(seq_arg(n, 1)) if x is not None]
    return [
        (
            n.args[0],
            dims,
            "an index by position or token into a value laid out along the sequence",
        )
    ]


def _index_put(n: fx.Node) -> list:
    dims = [i for i, x in enumerate(seq_arg(n, 1)) if x is not None]
    return [
        (n.args[0], dims, "an index by position or token into a value laid out along the sequence"),
        (n.args[2], list(range(_ndim(n.args[2]))), "tokens written at computed indices"),
    ]


def _scatter_like(dim_arg: int, src_arg: int) -> Callable:
    what = "a write along the sequence"

    def rule(n: fx.Node) -> list:
        d = _dim_arg(n, dim_arg, 0)
        return [(n.args[0], [d], what), (n.args[src_arg], [d], what)]

    return rule


def _slice_scatter(n: fx.Node) -> list:
    if whole_slice(n):  # the whole dim written: the value written, laid out as it is
        return []
    d = _dim_arg(n, 2, 0)
    return [(n.args[0], [d], "a write into a slice of the sequence"), (n.args[1], [d], "")]


def _cat(n: fx.Node) -> list:
    d = _dim_arg(n, 1, 0)
    return [(t, [d], "a concatenation along the sequence") for t in seq_arg(n, 0)]


def _layer_norm(n: fx.Node) -> list:
    k = len(seq_arg(n, 1))
    return [(n.args[0], list(range(-k, 0)), "a norm over the sequence")]


def _group_norm(n: fx.Node) -> list:
    """A group norm normalizes each entry of dim 0 over every other dim."""
    return [(n.args[0], list(range(1, _ndim(n.args[0]))), "a group norm over the sequence")]


def _triangle(n: fx.Node) -> list:
    return [(n.args[0], [-1, -2], "a triangle of a value along the sequence")]


_ALONG: dict[Any, Callable[[fx.Node], list]] = {
    # reductions, norms and softmaxes: over other dims only
    **dict.fromkeys(
        (
            aten.sum.dim_IntList,
            aten.mean.dim,
            aten.amax.default,
            aten.amin.default,
            aten.var.correction,
            aten.std.correction,
            aten.var_mean.correction,
            aten.std_mean.correction,
            aten.var.dim,
            aten.std.dim,
            aten.var_mean.dim,
            aten.std_mean.dim,
            aten.nansum.default,
            aten.nanmean.default,
            aten.count_nonzero.dim_IntList,
            aten.prod.dim_int,
            aten.any.dim,
            aten.all.dim,
            aten.max.dim,
            aten.min.dim,
            aten.argmax.default,
            aten.argmin.default,
            aten.logsumexp.default,
            aten.sum.default,
            aten.mean.default,
        ),
        _reduction,
    ),
    aten.linalg_vector_norm.default: _vector_norm,
    **dict.fromkeys(
        (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default),
        _along(SOFTMAX, lambda n: [int_arg(n, 1)]),
    ),
    aten.layer_norm.default: _layer_norm,
    aten.native_layer_norm.default: _layer_norm,
    aten.group_norm.default: _group_norm,
    aten.native_group_norm.default: _group_norm,
    aten.rms_norm.default: _layer_norm,
    aten.cumsum.default: _scan("cumsum"),
    aten.cumprod.default: _scan("cumprod"),
    aten.cummax.default: _scan("cummax"),
    aten.cummin.default: _scan("cummin"),
    aten.logcumsumexp.default: _scan("logcumsumexp"),
    aten.diff.default: _scan("diff"),
    aten.outer.default: _nothing,  # a[:, None] · b[None, :]: each output dim one operand's
    # pools and resampling over the trailing spatial dims (1d: the last; 2d: the last two)
    **dict.fromkeys(
        (
            aten.avg_pool1d.default,
            aten.max_pool1d.default,
            aten.max_pool1d_with_indices.default,
            aten.adaptive_avg_pool1d.default,
            aten.upsample_nearest1d.vec,
            aten.upsample_linear1d.vec,
        ),
        _along("a pool or resampling along the sequence", lambda n: [-1]),
    ),
    **dict.fromkeys(
        (
            aten.avg_pool2d.default,
            aten.max_pool2d.default,
            aten.max_pool2d_with_indices.default,
            aten.adaptive_avg_pool2d.default,
            aten.upsample_nearest2d.vec,
            aten.upsample_bilinear2d.vec,
        ),
        _along("a pool or resampling along the sequence", lambda n: [-2, -1]),
    ),
    # windows of a dim (``unfold(dim, size, step)``): along that dim, each window reads others
    aten.unfold.default: _along("a window of the sequence", lambda n: [_dim_arg(n, 1, 0)]),
    # Fourier transforms: along their dims only (each output entry reads every input entry)
    **dict.fromkeys(
        (
            aten.fft_rfft.default,
            aten.fft_irfft.default,
            aten.fft_fft.default,
            aten.fft_ifft.default,
        ),
        _along("an FFT along the sequence", lambda n: [_dim_arg(n, 2, -1)]),
    ),
    **dict.fromkeys(
        (aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default),
        _along("an FFT along the sequence", lambda n: list(seq_arg(n, 1))),
    ),
    aten.sort.default: _along("a sort along the sequence", lambda n: [_dim_arg(n, 1, -1)]),
    aten.topk.default: _along("a top-k along the sequence", lambda n: [_dim_arg(n, 2, -1)]),
    aten.flip.default: _along("a flip along the sequence", lambda n: list(seq_arg(n, 1))),
    aten.roll.default: _along(
        "a roll along the sequence",
        lambda n: list(_dim_arg(n, 2, [], "dims")) or list(range(_ndim(n.args[0]))),
    ),
    aten.tril.default: _triangle,
    aten.triu.default: _triangle,
    # rearrangements that keep the token order (the output's growing dim is found from sizes)
    **dict.fromkeys(
        (
            aten.transpose.int,
            aten.t.default,
            aten.permute.default,
            aten.unsqueeze.default,
            aten.squeeze.dim,
            aten.squeeze.dims,
            aten.squeeze.default,
            aten.expand_as.default,
            aten.stack.default,
            aten.alias.default,
            aten.movedim.int,
            aten.unbind.int,
        ),
        _nothing,
    ),
    aten.slice.Tensor: _slice,
    aten.select.int: _along("a select of one token", lambda n: [int_arg(n, 1)]),
    aten.narrow.default: _along("a slice of the sequence", lambda n: [int_arg(n, 1)]),
    aten.split.Tensor: _along("a split of the sequence", lambda n: [_dim_arg(n, 2, 0)]),
    aten.split_with_sizes.default: _along("a split of the sequence", lambda n: [_dim_arg(n, 2, 0)]),
    aten.chunk.default: _along("a split of the sequence", lambda n: [_dim_arg(n, 2, 0)]),
    aten.cat.default: _cat,
    aten.concat.default: _cat,  # an alias (PhiMoE's router)
    aten.concatenate.default: _cat,  # another (Zamba2's shared block)
    aten.repeat_interleave.self_int: _along(
        "a repeat along the sequence", lambda n: [_dim_arg(n, 2, 0)]
    ),
    # products: contract other dims; a product pairing tokens with tokens grows two dims
    aten.linear.default: lambda n: [
        (n.args[0], [-1], "a product summing over the sequence outside causal attention"),
        (n.args[1], [0, 1], "a product with token-dependent weights"),
    ],
    aten.mm.default: _contract(-1, lambda n: [0]),
    aten.addmm.default: _contract(-1, lambda n: [0], 1, 2),
    aten.bmm.default: _contract(-1, lambda n: [-2]),
    aten.matmul.default: _contract(-1, _matmul_b),
    # reads of tables at token-aligned indices; indexing into a value along its sequence is not
    aten.embedding.default: lambda n: [(n.args[0], [0], "an embedding table sized by tokens")],
    aten.index.Tensor: _index,
    aten.index_select.default: _along(
        "an index by position or token into a value laid out along the sequence",
        lambda n: [int_arg(n, 1)],
    ),
    aten.gather.default: _along("a gather along the sequence", lambda n: [int_arg(n, 1)]),
    aten.index_put.default: _index_put,
    aten.scatter.src: _scatter_like(1, 3),
    aten.scatter.value: _along("a write along the sequence", lambda n: [int_arg(n, 1)]),
    aten.scatter_add.default: _scatter_like(1, 3),
    aten.index_add.default: _scatter_like(1, 3),
    aten.slice_scatter.default: _slice_scatter,
    aten.select_scatter.default: lambda n: [
        (n.args[0], [n.args[2]], "a write of one token"),
        (n.args[1], [], ""),
    ],
}

_POINTWISE = frozenset(
    {
        aten._to_copy.default,
        aten.to.dtype,
        aten.to.dtype_layout,
        aten.to.device,
        aten.clone.default,
        aten.contiguous.default,
        aten.detach.default,
        aten.lift_fresh_copy.default,
        aten.type_as.default,
        aten.masked_fill.Tensor,
        aten.floor_divide.default,
        aten.fill.Scalar,
        aten.dropout.default,
        aten.native_dropout.default,
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.full_like.default,
        aten.empty_like.default,
        aten.rand_like.default,
        aten.randn_like.default,
        aten.bernoulli.p,
        aten.__and__.Tensor,
        aten.__or__.Tensor,
        aten.__xor__.Tensor,
        aten.where.ScalarOther,  # where(cond, x, c): element by element (Gemma 3n's AltUp)
        aten.where.ScalarSelf,
        aten.where.Scalar,
        aten.multiply.Tensor,  # aliases of mul, sub, div that carry no pointwise tag
        aten.subtract.Tensor,
        aten.divide.Tensor,
        aten.polar.default,  # Llama 4's complex rotary
        aten.view_as_complex.default,  # the pairs of the last dim, which is never the sequence
        aten.view_as_real.default,
        aten.real.default,  # complex parts, element by element (an S4 kernel's real part)
        aten.imag.default,
        aten._conj.default,  # what capture writes for ``.conj()``
        aten.complex.default,
        aten.log_sigmoid.default,  # elementwise ops torch tags no pointwise (xLSTM's gates)
        aten.hardswish.default,
    }
)
_PICKS = frozenset({aten.nonzero.default, aten.nonzero_numpy.default})
_OURS = frozenset({"aten", "autopart", "prims"})  # namespaces whose ops the rules know
_ROUTING_ENTRY = frozenset({aten.sort.default, *_PICKS})


# autopart's collectives and dropout work position by position (tp_gather / tp_scatter_reduce
# keep the token order of the sequence shards they join or split), by op name
_AUTOPART_LOCAL = frozenset(
    (
        "tp_copy",
        "tp_reduce",
        "tp_all_reduce_grad",
        "tp_gather",
        "tp_scatter_reduce",
        "tp_split",
        "tp_join",
        "dropout",
    )
)
# (x, dim, group, size): s/p ↔ s; the ops that split s, and those that join it
_SHARING = frozenset(("tp_gather", "tp_scatter_reduce", "tp_split", "tp_join"))
_SPLITTING = frozenset(("tp_scatter_reduce", "tp_split"))


def _factory(p: _Prover, n: fx.Node) -> Any:
    """A constant sized by the sequence (zeros, ones, full): the same at every token."""
    val = n.meta["val"]
    grow = p.growing(val)
    if len(grow) > 1:
        raise Mixes("a value pairing tokens with tokens (two dims sized by the sequence)")
    if not grow:
        return None
    return Seq(grow[0], ONE, p.part(val.shape[grow[0]]) or 1, const=p.rows)


def _expand(p: _Prover, n: fx.Node) -> Any:
    """An expand: of a value free of the sequence to a size that grows with it, a constant
    sized by the sequence (GPT-NeoX-Japanese's output bias, broadcast to [b, s, h] before it is
    added); otherwise a rearrangement that keeps the token order."""
    if p.env.get(node_arg(n, 0)) is None:
        return _factory(p, n)
    return p._carry(n)


# positions and running counts: the chunk pass (``sequence_chunk``) shifts them by the chunk's
# offset, and the rules below accept them


def _along_sequence(x: fx.Node, dim: int, gm: fx.GraphModule) -> bool:
    """The dim's size grows with the sequence (a size written as an expression of s that is
    constant, such as a head count under tp, is not)."""
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return False
    size = to_sympy(val.shape[dim % val.dim()], gm)
    if S not in size.free_symbols:
        return False
    others = {sym: 4 for sym in size.free_symbols - {S}}
    return len({size.subs({**others, S: n}) for n in (48, 96, 144)}) > 1


def is_length(x: fx.Node, dim: int, gm: fx.GraphModule) -> bool:
    """The dim's size is the sequence length itself: a running count along a dim of 2·s (or
    any other size that merely grows with s) is not c·(t + 1) at token t, and the chunk pass's
    shift by c · offset would be wrong (a probe's ``new_ones(2 * s).cumsum(0).view(2, s)``
    trained silently wrong under Seq1F1B: loss 7e-2 off)."""
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return False
    size = val.shape[dim % val.dim()]
    # compared at the prover's sample lengths: ``2*(s//2)``, the length of halves joined from
    # tp = 2 (sequence parallelism), is s (a carried cumsum after tp's join was refused)
    return to_sympy(size, gm) == S or _Prover(gm).part(size) == 1


_ONES = frozenset((aten.ones.default, aten.ones_like.default, aten.new_ones.default))
_ZEROS = frozenset((aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default))
_FULLS: dict[Any, int] = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}


def filled_with(n: fx.Node) -> int | float | None:
    """The constant the tensor ``n`` makes is filled with: 1 for ``ones``, 0 for ``zeros``, a
    ``full``'s number (the ``_like`` and ``new_`` forms too); None for anything else."""
    if n.op != "call_function":
        return None
    if n.target in _ONES:
        return 1
    if n.target in _ZEROS:
        return 0
    at = _FULLS.get(n.target)
    value = n.args[at] if at is not None and len(n.args) > at else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def fill_value(n: fx.Node, gm: fx.GraphModule) -> int | float | None:
    """c when ``n`` is ``cumsum(x, d)`` of a tensor x filled with the constant c (``ones``,
    ``full``) along the sequence dim d: a running count (OPT's positions, from the all-ones
    attention mask Hugging Face makes when none is given), whose value at global token t is
    c·(t + 1); over a chunk, the chunk's own cumsum plus c · offset. (A running count along
    another dim is the same in every chunk and needs nothing.)"""
    if n.target != aten.cumsum.default or n.meta.get(META_MASK_FN):
        return None
    x = n.args[0]
    dim = int_arg(n, 1, "dim")
    if not isinstance(x, fx.Node) or x.target in _ZEROS:
        return None
    c = filled_with(x)
    return c if c is not None and is_length(x, dim, gm) else None


def is_positions(n: fx.Node, gm: fx.GraphModule) -> bool:
    """``arange(s)`` or ``arange(0, s)`` over the sequence length, or the first s entries of a
    buffer holding 0, 1, 2, … along the sliced dim (GPT-1's ``position_ids``): token positions
    (not the key positions of a mask rebuilt by ``position_masks``, which the chunk pass sizes
    itself)."""
    if n.meta.get(META_MASK_FN):
        return False
    if n.target == aten.slice.Tensor:
        return _position_slice(n, gm) is not None
    if n.target == aten.arange.default:
        start: object = 0
    elif n.target == aten.arange.start or (
        n.target == aten.arange.start_step and len(n.args) > 2 and n.args[2] == 1
    ):
        start = n.args[0]  # arange(c, s + c): the positions plus c (log-n scaling's 1 … s)
    else:
        return False
    val = n.meta.get("val")
    if not isinstance(start, int) or isinstance(start, bool):
        return False
    if val is None or val.dim() != 1 or not isinstance(val.shape[0], torch.SymInt):
        return False
    expr = val.shape[0].node.expr
    return gm.meta.get(META_SYMBOLS, {}).get(expr) == S


def _position_slice(n: fx.Node, gm: fx.GraphModule) -> int | None:
    """The sliced dim, when ``n`` is ``buffer[..., 0:s]`` (step 1, s the sequence length) of a
    buffer whose entries are their own index along that dim (the same along every other)."""
    value = _buffer_value(node_arg(n, 0), gm)
    dim = _to_length(n, gm)
    if not isinstance(value, torch.Tensor) or dim is None or value.is_floating_point():
        return None
    index = torch.arange(value.shape[dim]).view([-1 if d == dim else 1 for d in range(value.dim())])
    return dim if bool((value == index).all()) else None


def table_rows(n: fx.Node, gm: fx.GraphModule) -> int | None:
    """The sliced dim, when ``n`` is ``table[..., 0:s]`` (step 1, s the sequence length) of a
    parameter, buffer or constant (or a fixed-size view of one) that is not the positions
    themselves (``_position_slice``) nor part of a rebuilt mask: row t is token t's (MiniMax's
    per-position decay, a learned position table sliced by the length), a function of the
    position; the chunk pass reads rows offset … offset + s − 1 instead."""
    if n.target != aten.slice.Tensor or n.meta.get(META_MASK_FN) or not _fixed(node_arg(n, 0)):
        return None
    return None if _position_slice(n, gm) is not None else _to_length(n, gm)


def _to_length(n: fx.Node, gm: fx.GraphModule) -> int | None:
    """The sliced dim, when the slice ``n`` is ``x[..., 0:s]`` (step 1, s the sequence
    length)."""
    val = n.meta.get("val")
    if not _is_tensor(val) or val.dim() == 0:
        return None
    dim = _dim_arg(n, 1, 0) % val.dim()
    start = n.args[2] if len(n.args) > 2 else None
    step = n.args[4] if len(n.args) > 4 else 1
    size = val.shape[dim]
    if start not in (None, 0) or step != 1 or not isinstance(size, torch.SymInt):
        return None
    return dim if gm.meta.get(META_SYMBOLS, {}).get(size.node.expr) == S else None


def _fixed(x: fx.Node) -> bool:
    """A parameter, buffer or constant, or a view of one with fixed sizes."""
    while x.target in (aten.unsqueeze.default, aten.view.default, aten.reshape.default):
        if not all(isinstance(a, int) for a in _flat(list(x.args[1:]))):
            return False
        x = node_arg(x, 0)
    ref = x.meta.get(META_INPUT) if x.op == "placeholder" else None
    return ref is not None and ref.kind in ("param", "buffer", "constant")


def _buffer_value(x: fx.Node, gm: fx.GraphModule) -> torch.Tensor | None:
    """The value of a buffer, or of fixed-size views of one (``unsqueeze``, ``view``)."""
    if x.op == "placeholder":
        ref = x.meta.get(META_INPUT)
        return gm.meta.get(META_BUFFERS, {}).get(ref.name) if ref is not None else None
    if x.target not in (aten.unsqueeze.default, aten.view.default, aten.reshape.default):
        return None
    if not all(isinstance(a, int) for a in _flat(list(x.args[1:]))):
        return None
    value = _buffer_value(node_arg(x, 0), gm)
    return None if value is None else x.target(value, *x.args[1:])


def _arange(p: _Prover, n: fx.Node) -> Any:
    grow = p.growing(n.meta["val"])
    if not grow:
        return None
    if is_positions(n, p.gm):
        return Seq(0, ONE)  # shifted by the chunk's offset
    if (
        n.target == aten.arange.default
        and n.users
        and all(u.target in _SLOT_USERS for u in n.users)
    ):
        return SLOTS  # slot indices of routed tokens: only the routing rule may read them
    raise Mixes(ARANGE)


ARANGE = (
    "an arange over a length derived from the sequence other than the positions 0 … s − 1 "
    "(each chunk would restart it)"
)


def _cumsum(p: _Prover, n: fx.Node) -> Any:
    if fill_value(n, p.gm) is not None:  # a running count, shifted by the chunk pass
        return p.env[node_arg(n, 0)]
    for x, dims, what in _scan("cumsum")(n):
        v = p.env.get(x)
        if isinstance(v, Seq) and v.dim % _ndim(x) in {d % _ndim(x) for d in dims}:
            raise Mixes(what)
    return p._carry(n)


def _attention(p: _Prover, n: fx.Node) -> Any:
    if n.meta.get(META_ATTENTION) != "causal":
        raise Mixes("an attention not proven causal")
    qkv = scored_qkv(n) if is_scored(n) else (node_arg(n, 0), node_arg(n, 1), node_arg(n, 2))
    for x in qkv:
        val = p.env.get(x)
        if not (
            isinstance(val, Seq)
            and val.dim % _ndim(x) == _ndim(x) - 2
            and val.inner == ONE
            and val.part == 1
        ):
            raise Mixes("a causal attention whose queries, keys or values are not per token")
    return Seq(_ndim(n) - 2, ONE)


@dataclass(frozen=True)
class Recurrence:
    """``autopart::linear_scan(a, b, dim)`` along the sequence (``autopart/frontend/loops.py``
    rolled a loop over the tokens into it): token t's state is a[t] · state[t − 1] + b[t], so
    a chunk needs only the last state of the chunk before it, which the chunk pass carries."""

    node: fx.Node
    dim: int

    @property
    def b(self) -> fx.Node:
        return node_arg(self.node, 1)


def recurrence(n: fx.Node) -> Recurrence | None:
    """``n`` as a ``Recurrence`` when it is a linear scan whose dim the prover found to be the
    sequence (``meta["autopart.seq_dim"]``), else None."""
    if n.target != LINEAR_SCAN or n.meta.get(META_SEQ_DIM) is None:
        return None
    nd = n.meta["val"].dim()
    dim = int_arg(n, 2) % nd
    return Recurrence(n, dim) if n.meta[META_SEQ_DIM] % nd == dim else None


_CARRIED_SCANS = {
    aten.cumprod.default: "cumprod",
    aten.logcumsumexp.default: "logcumsumexp",
    aten.cummax.default: "cummax",
    aten.cummin.default: "cummin",
}


@dataclass(frozen=True)
class CarriedScan:
    """A running product, log-sum-exp, max or min along the sequence: its value at token t is
    f(its value at t − 1, x[t]), so a chunk continues it from the value at the previous chunk's
    last token, which the chunk pass carries (scanning [carry; chunk] and dropping the carry's
    entry: the same operations, in the same order, as the unchunked scan; minGRU's and
    minLSTM's log-space scans, a running maximum)."""

    node: fx.Node
    dim: int

    @property
    def value(self) -> fx.Node:
        """A node of the running value's shape and dtype (the input of a cummax, whose output
        is a pair of values and positions)."""
        return node_arg(self.node, 0) if isinstance(self.node.meta["val"], tuple) else self.node


def carried_scan(n: fx.Node) -> CarriedScan | None:
    """``n`` as a ``CarriedScan`` when it scans along its input's sequence dim (the prover
    recorded it: ``meta["autopart.seq_dim"]``), else None."""
    if n.target not in _CARRIED_SCANS:
        return None
    x = node_arg(n, 0)
    seq, nd = x.meta.get(META_SEQ_DIM), _ndim(x)
    dim = _dim_arg(n, 1, 0) % nd
    return CarriedScan(n, dim) if seq is not None and seq % nd == dim else None


def _carried_scan(p: _Prover, n: fx.Node) -> Any:
    """A running product, log-sum-exp, max or min: along the sequence of every token of the
    chunk's own length, carried (``CarriedScan``); along another dim, token by token. The
    positions a cummax or cummin returns count from the scan's start: read, they are refused."""
    x, name = node_arg(n, 0), _CARRIED_SCANS[cast(Any, n.target)]
    v, nd = p.env.get(x), _ndim(x)
    if not (isinstance(v, Seq) and v.dim % nd == _dim_arg(n, 1, 0) % nd):
        return p._carry(n)
    if v.inner != ONE or v.part != 1 or not is_length(x, v.dim, p.gm):
        raise Mixes(
            f"a {name} along a tp rank's share of the sequence or along tokens merged with "
            "other dims"
        )
    if any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in n.users):
        raise Mixes(
            f"the positions a {name} along the sequence returns (each chunk would count them "
            "from its own first token)"
        )
    return p._carry(n)


def _rows_carried_scan(p: _Prover, n: fx.Node) -> Any:
    """Rows: a running product, log-sum-exp, max or min along any dim but the batch's."""
    return _carry_unless_along(p, n, _scan(_CARRIED_SCANS[cast(Any, n.target)])(n))


def _linear_scan(p: _Prover, n: fx.Node) -> Any:
    """A linear recurrence: along the sequence, a carried state (``Recurrence``); along another
    dim, token by token."""
    a, b = node_arg(n, 0), node_arg(n, 1)
    nd = _ndim(a)
    seqs = [p.env.get(x) for x in (a, b)]
    if len(n.args) > 3 and n.args[3] is not None:
        raise Mixes("a recurrence started from a given state")
    if not all(isinstance(v, Seq) for v in seqs):
        return p._carry(n)
    va, vb = cast("list[Seq]", seqs)
    if va.dim % nd != vb.dim % nd or va.inner != ONE or vb.inner != ONE:
        raise Mixes("a recurrence over tokens laid out differently or merged with other dims")
    if va.dim % nd == int_arg(n, 2) % nd and (va.part != 1 or vb.part != 1):
        raise Mixes("a recurrence along a tp rank's share of the sequence")
    return p._carry(n)


def _loss(p: _Prover, n: fx.Node) -> Any:
    """Cross entropy summed over the tokens: the chunks' sums add up (a mean would not)."""
    reduction = _dim_arg(n, 3, 1, "reduction")
    if n.target == aten.cross_entropy_loss.default and reduction == 0:
        x = node_arg(n, 0)
        if isinstance(p.env.get(x), Seq) and p.env[x].dim % _ndim(x) == 1:
            raise Mixes("a cross entropy over classes laid out along the sequence")
        return p._carry(n)
    if n.target == aten.cross_entropy_loss.default and reduction != 2:
        raise Mixes("a mean over the sequence (each chunk would divide by its own count)")
    for x in n.all_input_nodes:
        v = p.env.get(x)
        if isinstance(v, Seq) and _ndim(x) > 1 and v.dim % _ndim(x) != 0:
            raise Mixes("a cross entropy over classes laid out along the sequence")
    return SUMMED


def _carry_unless_along(p: _Prover, n: fx.Node, uses: Any) -> Any:
    """Refuse the first ``(value, dims, construct)`` of ``uses`` whose value carries the sequence
    in one of ``dims`` (the op mixes tokens there); else ``n`` carries its inputs' sequence dim."""
    for y, dims, what in uses:
        w = p.env.get(y)
        if isinstance(w, Seq) and w.dim % _ndim(y) in {d % _ndim(y) for d in dims}:
            raise Mixes(what)
    return p._carry(n)


def _sum_all(p: _Prover, n: fx.Node) -> Any:
    """A sum over every token reaching the loss (chunk sums add up); over other dims, local."""
    x = node_arg(n, 0)
    v = p.env.get(x)
    if isinstance(v, Seq) and not p.growing(n.meta["val"]):
        dims = _dims_arg(n, 1) if n.target == aten.sum.dim_IntList else list(range(_ndim(x)))
        if n.meta["val"].dim() == 0 and v.dim % _ndim(x) in {d % _ndim(x) for d in dims}:
            return SUMMED
    return _carry_unless_along(p, n, _reduction(n))


def _repeat(p: _Prover, n: fx.Node) -> Any:
    """Copies along other dims; along a dim in which the tokens are merged with an outer dim
    (``[b·s, h]`` → ``[E·b·s, h]``: Llama 4's dense experts), whole copies of every token's
    rows, so token t is still at index t (times ``inner``) modulo the chunk."""
    x = node_arg(n, 0)
    v = p.env.get(x)
    if v is None:  # copies of a value free of the tokens: the same at every token (BLOOM's ALiBi)
        return _factory(p, n)
    if isinstance(v, Seq):
        reps, nd = seq_arg(n, 1), _ndim(x)
        if reps[len(reps) - nd + v.dim % nd] != 1:
            sizes = p.at(x.meta["val"].shape[v.dim])
            tokens = [whole // v.part * i for (_, whole), i in zip(p.samples, v.inner, strict=True)]
            if any(size <= t for size, t in zip(sizes, tokens, strict=True)) and not (
                p.rows and _copies_split_off(p, n, v.dim % nd, reps[len(reps) - nd + v.dim % nd])
            ):
                raise Mixes("a repeat along the sequence")
    return p._carry(n)


def _repeat_interleave(p: _Prover, n: fx.Node) -> Any:
    """``x.repeat_interleave(k, dim)``: along the dim carrying the tokens (or the batch's
    rows), each entry k times in place, so token t moves from index t·i to t·i·k (transformers'
    ``batched_mm`` experts: every token's row once per chosen expert); along another dim,
    copies within each token. Flattening (no dim) or per-entry counts are not proven."""
    x = node_arg(n, 0)
    v = p.env.get(x)
    dim = _dim_arg(n, 2, None)
    reps = n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
    if isinstance(v, Seq) and (dim is None or dim % _ndim(x) == v.dim % _ndim(x)):
        if dim is None or not isinstance(reps, int) or v.block > 1:
            raise Mixes("a repeat along the sequence")
        return Seq(v.dim, tuple(i * reps for i in v.inner), v.part, v.block, v.const)
    return p._carry(n)


def _copies_split_off(p: _Prover, n: fx.Node, dim: int, copies: Any) -> bool:
    """Rows of the batch, the outermost index of dim 0, repeated ``copies`` times along it
    (Llama 4's dense experts: ``x.repeat(E, 1)`` of ``[b·s, h]``), and every reader viewing the
    copies off as a dim of their own (``view(E, b·s, h)``): each copy holds every row once, in
    order."""
    x = node_arg(n, 0)
    whole = p.at(x.meta["val"].shape[0])
    if dim != 0 or not isinstance(copies, int) or not n.users:
        return False
    frontier, seen = [n], {n}
    while frontier:  # through elementwise ops of the same shape (the router's weights)
        for u in frontier.pop().users:
            val = u.meta.get("val")
            shape = val.shape if _is_tensor(val) else ()
            if u in seen:
                continue
            seen.add(u)
            if u.target in _VIEWS and len(shape) >= 2 and shape[0] == copies:
                if p.at(shape[1]) != whole:
                    return False
            elif (
                torch.Tag.pointwise in getattr(u.target, "tags", ())
                and shape == n.meta["val"].shape
            ):
                frontier.append(u)
            else:
                return False
    return True


def _view(p: _Prover, n: fx.Node) -> Any:
    """A view keeps the elements' order: the token index keeps its stride, which must fall
    inside one output dim (``[b, s, h]`` ↔ ``[b·s, h]`` ↔ ``[b, s, heads, d]``). A scan's
    blocks: ``[b, s, h]`` → ``[b, s/Q, Q, h]`` lays the tokens out as blocks of a constant Q
    (``Seq.block``), and ``[b, s/Q, Q', h]`` → ``[b, s, h]`` (Q' = Q: any order inside a block)
    lays them out as tokens again."""
    x = node_arg(n, 0)
    v = p.env.get(x)
    if not isinstance(v, Seq):
        return p._carry(n)
    src = x.meta["val"].shape
    if v.block > 1:
        if v.inner != ONE:
            raise Mixes("a view of blocks of the sequence merged with another dim")
        d = v.dim % len(src)
        if d + 1 < len(src) and all(q == v.block for q in p.at(src[d + 1])):  # blocks → tokens
            return _view_search(p, n, v, lambda k: math.prod(p.at(e)[k] for e in src[d + 2 :]))
        return _view_search(p, n, v, None)  # blocks stay blocks
    try:
        return _view_search(p, n, v, None)
    except Mixes:
        if v.inner != ONE:
            raise
        return _view_blocks(p, n, v)


def _view_search(p: _Prover, n: fx.Node, v: Seq, token_stride: Callable | None) -> Seq:
    """The output dim holding the token index (or, for ``v``'s blocks, the block index) at the
    same stride as in ``v``; ``token_stride``: view ``v``'s blocks as tokens with this stride."""
    src, dst = node_arg(n, 0).meta["val"].shape, n.meta["val"].shape
    found: set[int] = set()
    inner: list[int] = []
    block = 1 if token_stride is not None else v.block
    for k, (_, whole) in enumerate(p.samples):
        s = whole // v.part // block  # the tokens (blocks) this rank holds
        src_k = [p.at(d)[k] for d in src]
        dst_k = [p.at(d)[k] for d in dst]
        if token_stride is not None:
            stride = token_stride(k)
        else:
            stride = v.inner[k] * math.prod(src_k[v.dim % len(src_k) + 1 :])
        for j in range(len(dst_k)):
            right = math.prod(dst_k[j + 1 :])
            if dst_k[j] >= s and stride % right == 0 and (right * dst_k[j]) % (stride * s) == 0:
                found.add(j)
                inner.append(stride // right)
                break
        else:
            raise Mixes("a view that cuts the sequence across dims")
    if len(found) != 1:
        raise Mixes("a view that moves the sequence between dims")
    return Seq(found.pop(), tuple(inner), v.part, block)


def _view_blocks(p: _Prover, n: fx.Node, v: Seq) -> Seq:
    """``[.., s, rest]`` → ``[.., s/Q, Q·rest/r, r]``-like views: the tokens in blocks of a
    constant Q > 1, one block per index of the output dim (a chunked scan's layout)."""
    src, dst = node_arg(n, 0).meta["val"].shape, n.meta["val"].shape
    found: set[tuple[int, int]] = set()
    for k, (_, whole) in enumerate(p.samples):
        s = whole // v.part
        src_k = [p.at(d)[k] for d in src]
        dst_k = [p.at(d)[k] for d in dst]
        stride = math.prod(src_k[v.dim % len(src_k) + 1 :])
        hits = [
            (j, right // stride)
            for j in range(len(dst_k))
            if (right := math.prod(dst_k[j + 1 :])) % stride == 0
            and right // stride > 1
            and dst_k[j] * (right // stride) == s
        ]
        if len(hits) != 1:
            raise Mixes("a view that cuts the sequence across dims")
        found.add(hits[0])
    if len(found) != 1:
        raise Mixes("a view that cuts the sequence across dims")
    j, q = found.pop()
    p.block = math.lcm(p.block, q)  # a block may mix its tokens: chunks must be whole blocks
    return Seq(j, ONE, v.part, q)


# -- causal convolutions along the sequence ---------------------------------------------------

CONVS = frozenset(
    (
        aten.conv1d.default,
        aten.conv1d.padding,
        aten.conv2d.default,
        aten.convolution.default,
        aten._convolution.default,
    )
)
_PADS = frozenset((aten.constant_pad_nd.default, aten.pad.default))
CONV = "a convolution along the sequence"


@dataclass(frozen=True)
class CausalConv:
    """A convolution along the sequence whose output at token t reads the inputs t − window …
    t only: one spatial dim (the input's last, the sequence), stride 1, dilation d, kernel k,
    window = (k − 1)·d, zero-padded by the window on the left only — by a pad before it
    (``F.pad(x, (window, 0))``, then no padding) or by its own symmetric padding, every output
    past the first s cut off after it (``nn.Conv1d(padding=k − 1)(x)[..., :s]``: LFM2,
    Mamba). Any groups (depthwise or not): channels are not tokens. The chunk pass feeds
    each chunk the previous chunk's last ``window`` inputs in place of the zeros."""

    conv: fx.Node
    x: fx.Node  # the input before the padding: laid out along the sequence in ``dim``
    dim: int  # the sequence dim of ``x``: the conv's spatial dim, its last
    window: int  # (k − 1)·d: how many inputs before t the output at t reads
    pad: fx.Node | None  # the left pad before the conv, or None
    slices: tuple[fx.Node, ...]  # the symmetric form's cuts keeping the first s outputs


def causal_conv(n: fx.Node, live: set[fx.Node] | None = None) -> CausalConv | str:
    """``n``'s causal form, or what keeps it from being one (the end of the sentence "a
    convolution along the sequence …"). ``live``: the users that count (all when None)."""
    a = _bound(n)
    x, w = a.get("input"), a.get("weight")
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    wv = w.meta.get("val") if isinstance(w, fx.Node) else None
    if not (_is_tensor(xv) and _is_tensor(wv)) or wv.dim() != 3 or xv.dim() not in (2, 3):
        return "over more than one dim (only a 1-d convolution along the sequence is chunked)"
    assert isinstance(x, fx.Node)  # it has a value
    if a.get("transposed"):
        return "transposed (its output at t reads later inputs)"
    stride, dilation = _one(a.get("stride")), _one(a.get("dilation"))
    k = wv.shape[-1]
    if stride != 1:
        return f"with stride {stride} (only stride 1 keeps one output per token)"
    if not isinstance(dilation, int) or not isinstance(k, int) or dilation < 1:
        return f"with a kernel or dilation not fixed at capture ({k}, {dilation})"
    window, dim = (k - 1) * dilation, xv.dim() - 1
    padding = a.get("padding")
    padding = 0 if padding == "valid" else _one(padding)
    users = tuple(u for u in n.users if live is None or u in live)
    if padding == 0:
        if window == 0:  # a kernel of 1: token by token
            return CausalConv(n, x, dim, 0, None, ())
        if x.op == "call_function" and x.target in _PADS and _left_pad(x) == window:
            return CausalConv(n, node_arg(x, 0), dim, window, x, ())
        left = _left_pad(x) if x.op == "call_function" and x.target in _PADS else None
        return f"with a window of {window} inputs (kernel {k}, dilation {dilation}) " + (
            f"padded by {left} on the left"
            if left
            else "not zero-padded by it on the left (it is not causal)"
        )
    if padding == window and users and all(_keeps_first(u, n, x, dim, window) for u in users):
        return CausalConv(n, x, dim, window, None, users)
    if padding == window:
        return (
            f"padded by {window} on both sides and not cut back to its first s outputs "
            f"(not causal: the output at t reads the inputs up to t + {window})"
        )
    return (
        f"padded by {padding} for a window of {window} inputs (kernel {k}, dilation "
        f"{dilation}): only (k − 1)·d on the left is causal"
    )


def _bound(n: fx.Node) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(cast(Any, n.target)._schema.arguments):
        if i < len(n.args):
            out[arg.name] = n.args[i]
        elif arg.name in n.kwargs:
            out[arg.name] = n.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _one(x: Any) -> Any:
    """The one int of a 1-d conv's ``[v]`` (or ``v``); anything else as it is."""
    return x[0] if isinstance(x, (list, tuple)) and len(x) == 1 else x


def _left_pad(pad: fx.Node) -> int | None:
    """L when ``pad`` zero-pads its input's last dim by L on the left and nothing else."""
    amounts = _zero_pad_amounts(pad)
    if amounts is None or len(amounts) < 2 or any(amounts[1:]) or amounts[0] <= 0:
        return None
    return amounts[0]


@dataclass(frozen=True)
class TokenShift:
    """``x`` moved ``shift`` tokens later along the sequence, zeros in its first ``shift``
    places: a zero pad by ``shift`` before the sequence and by −``shift`` after it (the cut of
    its last ``shift``), nothing along other dims — RWKV's time shift
    ``nn.ZeroPad2d((0, 0, 1, −1))``, ``F.pad(x, (0, 0, 1, −1))``. Its output at t is the input
    at t − shift, so the chunk pass hands each chunk the previous chunk's last ``shift`` inputs
    in place of the zeros, as it does a causal convolution's window."""

    node: fx.Node
    x: fx.Node
    dim: int  # the dim of ``x`` it shifts along (the sequence's, for the chunk pass)
    shift: int


def token_shift(n: fx.Node) -> TokenShift | None:
    """``n`` as a ``TokenShift`` along one dim, or None."""
    if n.op != "call_function" or n.target not in _PADS:
        return None
    amounts = _zero_pad_amounts(n)
    x = node_arg(n, 0)
    if amounts is None or not isinstance(x, fx.Node):
        return None
    moved = [i for i, a in enumerate(amounts) if a]
    if len(moved) != 2 or moved[0] % 2 or moved[1] != moved[0] + 1:
        return None
    before, after = amounts[moved[0]], amounts[moved[1]]
    if before <= 0 or after != -before:
        return None
    return TokenShift(n, x, _ndim(x) - 1 - moved[0] // 2, before)


def _zero_pad_amounts(pad: fx.Node) -> list[int] | None:
    """The amounts of ``pad`` (last dim first, before then after) when it pads with zeros
    by fixed amounts; else None."""
    a = _bound(pad)
    amounts = a.get("pad")
    if pad.target == aten.pad.default and (a.get("mode") != "constant" or a.get("value")):
        return None
    if pad.target == aten.constant_pad_nd.default and a.get("value") != 0:
        return None
    if not isinstance(amounts, (list, tuple)):
        return None
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in amounts):
        return None
    return list(amounts)


def _keeps_first(u: fx.Node, conv: fx.Node, x: fx.Node, dim: int, window: int) -> bool:
    """``u`` is ``conv(...)[..., :s]``: a slice of the conv's output along ``dim`` from 0,
    step 1, to the input's length s (or to −window)."""
    if u.target != aten.slice.Tensor or u.args[0] is not conv:
        return False
    a = _bound(u)
    nd = conv.meta["val"].dim()
    if a.get("dim") % nd != dim or a.get("start") not in (None, 0) or a.get("step") != 1:
        return False
    end, size = a.get("end"), x.meta["val"].shape[dim]
    end = end.meta.get("val") if isinstance(end, fx.Node) else end
    if isinstance(end, int) and end == -window:
        return True
    return isinstance(end, torch.SymInt) and _same_size(end, size, conv)


def _convolution(p: _Prover, n: fx.Node) -> Any:
    """A convolution: per token when the sequence is its batch dim; along the sequence only in
    the causal form ``causal_conv`` recognizes (the chunk pass carries its window)."""
    a = _bound(n)
    x = a["input"]
    for y in (a.get("weight"), a.get("bias")):
        if isinstance(y, fx.Node) and p.env.get(y) is not None:
            raise Mixes("a convolution whose weights are tokens")
    v, nd = p.env.get(x), _ndim(x)
    batched = _is_tensor(a["weight"].meta.get("val")) and nd == _ndim(a["weight"])
    if p.rows:  # the batch in the sequence's place: only as the convolution's own batch dim
        if isinstance(v, Seq) and not (batched and v.dim % nd == 0):
            raise Mixes("a convolution along the sequence")
        return p._carry(n)
    form = causal_conv(n, p.live)
    if v is PADDED:  # x: a left pad that only convolutions read
        if isinstance(form, CausalConv) and form.pad is x:
            return Seq(form.dim, ONE)
        raise Mixes(f"{CONV} {form if isinstance(form, str) else 'padded on the left twice'}")
    if not isinstance(v, Seq):
        return p._carry(n)
    if batched and v.dim % nd == 0:  # the sequence is the conv's batch: each token alone
        return p._carry(n)
    if isinstance(form, str):
        raise Mixes(f"{CONV} {form}")
    if v.dim % nd != form.dim or form.pad is not None:
        raise Mixes("a convolution over channels laid out along the sequence")
    if v.inner != ONE:
        raise Mixes(f"{CONV} whose tokens are merged with another dim")
    if v.part != 1:
        raise Mixes(f"{CONV} over a tp rank's share of it (sequence parallelism)")
    return WINDOWED if form.slices else Seq(form.dim, ONE)


def _padding(p: _Prover, n: fx.Node) -> Any:
    """A pad along other dims; a causal convolution's left pad along the sequence, read by
    convolutions only (``PADDED``: each of them proves its own window, or is refused); or a
    token shift along it (``TokenShift``: the chunk pass carries the shifted-out inputs)."""
    x = node_arg(n, 0)
    v = p.env.get(x)
    users = [u for u in n.users if u in p.live]
    if (
        isinstance(v, Seq)
        and v.dim % _ndim(x) == _ndim(x) - 1
        and v.inner == ONE
        and v.part == 1
        and v.block == 1
        and _left_pad(n) is not None
        and users
        and all(u.target in CONVS and u.args[0] is n for u in users)
    ):
        return PADDED
    shift = token_shift(n)
    if shift is not None and isinstance(v, Seq) and v.dim % _ndim(x) == shift.dim:
        if v.inner != ONE or v.block != 1:
            raise Mixes("a token shift of tokens merged with another dim")
        if v.part != 1:
            raise Mixes(
                "a token shift over a tp rank's share of the sequence (sequence parallelism)"
            )
        if v.const:
            raise Mixes("a token shift of a constant")
        return p._carry(n)  # the chunk pass carries the last ``shift`` inputs
    return _carry_unless_along(p, n, _pad(n))


def _window_user(p: _Prover, n: fx.Node) -> Any:
    """A node reading a causal convolution's padded value: only the cut back to its first s
    outputs may (``causal_conv`` found every one of them)."""
    for a in n.all_input_nodes:
        if p.env.get(a) is WINDOWED:
            form = causal_conv(a, p.live)
            if isinstance(form, CausalConv) and n in form.slices:
                return Seq(form.dim, ONE)
    raise Mixes(f"a padded value of {CONV} read other than by it")


# -- state scans: a linear recurrence over blocks of the sequence, its state carried ----------


def explicit_einsum(eq: str, ranks: list[int]) -> str | None:
    """``eq`` for operands of ``ranks`` dims with every dim lettered: an ellipsis becomes fresh
    letters (right-aligned, as einsum broadcasts it) and an implicit output the ellipsis's
    letters then those that appear once, in order (``'...id,...jd'`` of 3-dim operands:
    ``'Aid,Ajd->Aij'``); None if it does not fit the ranks."""
    terms_out = eq.replace(" ", "").split("->")
    terms = terms_out[0].split(",")
    if len(terms) != len(ranks) or len(terms_out) > 2:
        return None
    named = [t.replace("...", "") for t in terms]
    if not all(t.isalpha() or not t for t in named):
        return None
    spans = [
        r - len(t) if "..." in full else 0 for full, t, r in zip(terms, named, ranks, strict=True)
    ]
    used = set("".join(named))
    fresh = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in used][: max(spans, default=0)]
    if min(spans, default=0) < 0 or len(fresh) < max(spans, default=0):
        return None
    lettered = [
        full.replace("...", "".join(fresh[len(fresh) - k :]))
        for full, k in zip(terms, spans, strict=True)
    ]
    if any(len(t) != r for t, r in zip(lettered, ranks, strict=True)):
        return None
    if len(terms_out) == 2:
        out = terms_out[1].replace("...", "".join(fresh))
    else:
        once = [c for c in sorted(used) if "".join(named).count(c) == 1]
        out = "".join(fresh) + "".join(once)
    return ",".join(lettered) + "->" + out


def _einsum(p: _Prover, n: fx.Node) -> Any:
    """``einsum``, its dims lettered (``explicit_einsum``): the sequence's letter stays in
    the output (a product over other dims); summing over it is mixing (a recognized
    ``StateScan`` is not this rule's)."""
    eq, ops = n.args[0], cast(Any, n.args[1])
    vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in ops]
    ranks = [v.dim() for v in vals if _is_tensor(v)]
    full = explicit_einsum(eq, ranks) if isinstance(eq, str) and len(ranks) == len(ops) else None
    if full is None:
        raise Unproven(f"einsum {eq!r} (its operands' dims could not be lettered)")
    ins, out = full.split("->")
    for x, letters in zip(ops, ins.split(","), strict=True):
        v = p.env.get(x)
        if isinstance(v, Seq):
            letter = letters[v.dim % len(letters)]
            if letter not in out or letters.count(letter) > 1:
                raise Mixes("a product summing over the sequence outside causal attention")
    return p._carry(n)


def moduli(expr: sympy.Expr) -> set[int]:
    """The integer moduli of an expression's ``Mod`` terms (sympy's and torch's own)."""
    return {
        int(m.args[1])
        for m in sympy.preorder_traversal(expr)
        if "Mod" in type(m).__name__ and len(m.args) == 2 and m.args[1].is_Integer
    }


def _round_block(val: Any, gm: fx.GraphModule) -> int | None:
    """Q when the size ``val`` is 0 at every length that is a multiple of Q (the smallest such Q
    among the moduli in its expression), else None."""
    if not isinstance(val, torch.SymInt):
        return None
    expr = to_sympy(val, gm)
    if S not in expr.free_symbols:
        return None
    others = {sym: 4 for sym in expr.free_symbols - {S}}
    for q in sorted(m for m in moduli(expr) if m > 1):
        if all(expr.xreplace({**others, S: q * k}) == 0 for k in (1, 2, 3, 5, 8)):
            return q
    return None


def _round_pad(p: _Prover, n: fx.Node) -> Any:
    """A constant pad at the end of the sequence by ``Round(Q)`` (to whole blocks): with chunk
    lengths multiples of Q it pads nothing but the last chunk, by what it pads the sequence.
    Every chunk length must then be a multiple of Q (``_Prover.block``)."""
    a = _bound(n)
    x = node_arg(n, 0)
    v, nd = p.env.get(x), _ndim(x)
    if (n.target == aten.pad.default and a.get("mode") != "constant") or not (
        isinstance(v, Seq) and v.block == 1 and v.inner == ONE and v.part == 1
    ):
        raise Mixes("a pad to whole blocks of a value not laid out as the sequence's tokens")
    for i, amount in enumerate(a["pad"]):
        dim = nd - 1 - i // 2
        r = p.env.get(amount) if isinstance(amount, fx.Node) else None
        if isinstance(r, Round) and dim == v.dim % nd and i % 2 == 1:
            p.block = math.lcm(p.block, r.block)
        elif isinstance(amount, fx.Node) and r is not None:
            raise Mixes("the sequence length used as a value (each chunk has its own)")
        elif dim == v.dim % nd and not (isinstance(amount, int) and amount == 0):
            raise Mixes("a pad along the sequence (a convolution's window, say)")
    return Seq(v.dim % nd, ONE)


@dataclass(frozen=True)
class StateScan:
    """``einsum(eq, [D, cat([Z, X], z)])`` over blocks of the sequence, as Mamba-2's SSD hands
    its state from block to block (Hugging Face's ``mamba2_chunk_scan``):

    - ``X``: one state per block (``Seq`` with blocks, along dim ``z``); ``Z``: zeros, one
      block long — the state before the first block;
    - ``D = exp(segsum(pad(u, [1, 0])))`` permuted: u one decay per block (``Seq`` with blocks,
      its last dim), ``segsum`` = ``masked_fill(cumsum(masked_fill(expand(T[..., None]),
      ~tril(ones(N, N), -1), 0), -2), ~tril(ones(N, N)), -inf)``, so D[i, j] = exp(T[j+1] + …
      + T[i]) for j ≤ i and 0 above;
    - the einsum contracts D's source index j with X's block dim and keeps the target i:
      out[i] = Σ_{j≤i} D[i, j]·[Z; X][j] = the state before block i (out[0] = Z), that is
      out[i] = exp(T[i])·out[i−1] + [Z; X][i], a linear recurrence;
    - read by ``out[:, :-1]`` (the state before each block) and ``out[:, -1]`` (after the last).

    With chunks cut at whole blocks, a chunk that starts from Z = the previous chunk's
    ``out[:, -1]`` computes exactly the states of the whole sequence: the chunk pass carries it
    (``StateScan.roles`` names the nodes the prover assigns)."""

    einsum: fx.Node
    cat: fx.Node
    zeros: fx.Node
    states: fx.Node
    dim: int  # the block dim of X and of the cat
    pad: fx.Node
    totals: fx.Node  # u
    chain: tuple[fx.Node, ...]  # from the pad's unsqueeze to D
    masks: tuple[fx.Node, ...]  # the two triangles' ones, tril and not
    shape: tuple[fx.Node, ...]  # slices only Z's shape reads
    out_dim: int
    head: tuple[fx.Node, ...]  # out[:, :-1]
    final: tuple[fx.Node, ...]  # out[:, -1] (or out[:, -1:])
    passes: tuple[fx.Node, ...]  # whole slices between the einsum and its readers

    def roles(self) -> list[tuple[str, tuple[fx.Node, ...]]]:
        return [
            ("shape", self.shape),
            ("states", (self.cat,)),
            ("totals", (self.pad,)),
            ("inside", self.chain + self.masks),
            ("scan", (self.einsum, *self.passes)),
            ("head", self.head),
            ("final", self.final),
        ]


_NOT = frozenset((aten.bitwise_not.default, aten.logical_not.default))
_PERMUTES = frozenset((aten.permute.default, aten.transpose.int))


def state_scan(n: fx.Node, live: set[fx.Node] | None = None) -> StateScan | str:
    """The ``StateScan`` whose einsum is ``n``, or why ``n`` is not one."""
    if n.target != aten.einsum.default or not isinstance(n.args[0], str):
        return "not an einsum"
    eq, ops = n.args[0].replace(" ", ""), cast(Any, n.args[1])
    if "->" not in eq or "..." in eq or not isinstance(ops, (list, tuple)) or len(ops) != 2:
        return "not an einsum of two operands with an explicit output"
    ins, out = eq.split("->")
    terms = ins.split(",")
    cats = _scan_states(n)
    if not cats or any(len(set(t)) != len(t) for t in terms):
        return "no concatenated states"
    ci = ops.index(cats[0])
    cat, d_op = cats[0], cast(fx.Node, ops[1 - ci])
    parts: Any = cat.args[0]
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2):
        return "the states are not [zeros; states]"
    z, x = parts
    nd = _ndim(cat)
    dim = _dim_arg(cat, 1, 0) % nd
    zval = z.meta.get("val")
    if z.target not in _ZEROS or not _is_tensor(zval) or zval.shape[dim] != 1:
        return "the state before the first block is not zeros, one block long"
    if z.target != aten.zeros.default and not _is_tensor(node_arg(z, 0).meta.get("val")):
        return "the zeros' shape is not a tensor's"
    # D, back through its permutations to exp(segsum(T))
    order = list(range(_ndim(d_op)))  # D's dim k is the segsum's dim order[k]
    node, chain = d_op, []
    while node.target in _PERMUTES:
        chain.append(node)
        m = _ndim(node)
        if node.target == aten.transpose.int:
            a, b = int_arg(node, 1) % m, int_arg(node, 2) % m
            order[a], order[b] = order[b], order[a]
        else:
            order = [order[k % m] for k in seq_arg(node, 1)]
        node = node_arg(node, 0)
    found = _segsum(node)
    if isinstance(found, str):
        return found
    pad, u, nodes, masks = found
    chain += nodes
    m = _ndim(node)
    i_pos, j_pos = order.index(m - 2), order.index(m - 1)  # target i, source j in D
    letters_d, letters_x = terms[1 - ci], terms[ci]
    li, lj = letters_d[i_pos], letters_d[j_pos]
    if letters_x[dim] != lj or lj in out or li not in out or li in letters_x:
        return "the product does not sum the states over the source block into the target"
    if not _same_size(pad.meta["val"].shape[-1], cat.meta["val"].shape[dim], n):
        return "the decays and the states count different blocks"
    out_dim = out.index(li)
    head: list[fx.Node] = []
    final: list[fx.Node] = []
    passes: list[fx.Node] = []
    stack = [u for u in n.users if live is None or u in live]
    while stack:
        r = stack.pop()
        if r.target == aten.slice.Tensor and whole_slice(r) and int_arg(r, 1) % nd != out_dim:
            passes.append(r)
            stack += [u for u in r.users if live is None or u in live]
        elif _cut(r, out_dim, nd) == "head":
            head.append(r)
        elif _cut(r, out_dim, nd) == "final":
            final.append(r)
        else:
            return f"the scan's states are read by {r.name}, not as out[:, :-1] or out[:, -1]"
    w = node_arg(z, 0) if z.target != aten.zeros.default else None
    shape = (
        (w,)
        if w is not None
        and w.target == aten.slice.Tensor
        and all(u.target in _ZEROS for u in w.users)
        else ()
    )
    return StateScan(
        n, cat, z, x, dim, pad, u, tuple(chain), masks, shape, out_dim,
        tuple(head), tuple(final), tuple(passes),
    )  # fmt: skip


def _scan_states(n: fx.Node) -> list[fx.Node]:
    """The concatenations an einsum ``n`` reads (a state scan's states), if any."""
    ops: Any = n.args[1] if n.target == aten.einsum.default and len(n.args) > 1 else ()
    return [x for x in ops if getattr(x, "target", None) == aten.cat.default]


def _cut(r: fx.Node, dim: int, nd: int) -> str | None:
    """ "head" for ``r = out[:, :-1]``, "final" for ``out[:, -1]`` / ``out[:, -1:]`` (along
    ``dim``), else None."""
    if r.target == aten.select.int and int_arg(r, 1) % nd == dim and r.args[2] == -1:
        return "final"
    if r.target != aten.slice.Tensor or int_arg(r, 1) % nd != dim:
        return None
    start, end, step = (list(r.args[2:]) + [None, None, 1][len(r.args) - 2 :])[:3]
    if step != 1:
        return None
    if start in (None, 0) and end == -1:
        return "head"
    if start == -1 and (end is None or (isinstance(end, int) and end >= 2**62)):
        return "final"
    return None


def _segsum(e: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node], tuple[fx.Node, ...]] | str:
    """``exp(segsum(pad(u, [1, 0])))`` as ``StateScan`` spells it: (the pad, u, the nodes from
    the pad's unsqueeze to the exp, the masks' nodes), or what differs."""
    what = "the decays are not exp of a segment sum of per-block values"
    if e.target != aten.exp.default:
        return what
    hi = node_arg(e, 0)
    if hi.target != aten.masked_fill.Scalar or float(cast(Any, hi.args[2])) != float("-inf"):
        return what
    cum = node_arg(hi, 0)
    if cum.target != aten.cumsum.default or int_arg(cum, 1) % _ndim(cum) != _ndim(cum) - 2:
        return what
    lo = node_arg(cum, 0)
    if lo.target != aten.masked_fill.Scalar or float(cast(Any, lo.args[2])) != 0.0:
        return what
    ex = node_arg(lo, 0)
    if ex.target != aten.expand.default:
        return what
    un = node_arg(ex, 0)
    if un.target != aten.unsqueeze.default or int_arg(un, 1) % _ndim(ex) != _ndim(ex) - 1:
        return what
    pad = node_arg(un, 0)
    mask_hi, mask_lo = _triangle_mask(hi.args[1], 0), _triangle_mask(lo.args[1], -1)
    if mask_hi is None or mask_lo is None:
        return "the segment sum's masks are not the triangles below the diagonal"
    a = _bound(pad) if pad.target in _PADS else {}
    if (
        pad.target not in _PADS
        or list(a.get("pad", ())) != [1, 0]
        or (pad.target == aten.pad.default and (a.get("mode") != "constant" or a.get("value")))
        or (pad.target == aten.constant_pad_nd.default and a.get("value") != 0)
    ):
        return "the decays do not start with a zero (pad(u, [1, 0]))"
    shape_ex, shape_pad = ex.meta["val"].shape, pad.meta["val"].shape
    want = (*shape_pad, shape_pad[-1])
    if len(shape_ex) != len(want) or not all(
        _same_size(a, b, e) for a, b in zip(shape_ex, want, strict=True)
    ):
        return what
    return pad, node_arg(pad, 0), [un, ex, lo, cum, hi, e], mask_hi + mask_lo


def _triangle_mask(m: Any, diagonal: int) -> tuple[fx.Node, ...] | None:
    """The nodes of ``~tril(ones(N, N, dtype=bool), diagonal)``, or None."""
    if not isinstance(m, fx.Node) or m.target not in _NOT:
        return None
    t = node_arg(m, 0)
    if t.target != aten.tril.default or (t.args[1] if len(t.args) > 1 else 0) != diagonal:
        return None
    o = node_arg(t, 0)
    val = o.meta.get("val")
    if o.target != aten.ones.default or not _is_tensor(val) or val.dtype != torch.bool:
        return None
    if val.dim() != 2 or not _same_size(val.shape[0], val.shape[1], o):
        return None
    return (m, t, o)


def _same_size(a: Any, b: Any, n: fx.Node) -> bool:
    """Two sizes of ``n``'s graph equal at every length it runs, compared at the prover's
    sample lengths: ``2*(s//2)``, a length joined from tp = 2 halves (sequence parallelism), is
    s then (tp divides every length), as is a size computed from it."""
    if str(a) == str(b):
        return True
    if not isinstance(a, torch.SymInt) and not isinstance(b, torch.SymInt):
        return False
    gm = n.graph.owning_module
    assert gm is not None
    p = _Prover(gm)
    return p.at(a) == p.at(b)


def _scan_part(p: _Prover, n: fx.Node) -> Any:
    """A node of a recognized ``StateScan``, by its role."""
    role, scan = p.scans[n]
    if role == "shape":  # only the zeros' shape reads it (one block: a constant)
        return None
    if role == "states":
        v = p.env.get(scan.states)
        if not (isinstance(v, Seq) and v.dim % _ndim(scan.states) == scan.dim and v.inner == ONE):
            raise Mixes("a state scan whose states are not one per block of the sequence")
        if p.env.get(scan.zeros) is not None:
            raise Mixes("a state scan whose first state depends on the sequence")
        return SCAN
    if role == "totals":
        v, w = p.env.get(scan.totals), p.env.get(scan.states)
        if not (
            isinstance(v, Seq)
            and v.dim % _ndim(scan.totals) == _ndim(scan.totals) - 1
            and isinstance(w, Seq)
            and (v.inner, v.part, v.block) == (w.inner, w.part, w.block)
        ):
            raise Mixes("a state scan whose decays are not one per block of its states")
        return SCAN
    if role == "inside":
        if any(a not in p.scans and p.env.get(a) not in (None, LENGTH) for a in n.all_input_nodes):
            raise Mixes("a state scan's decays computed from other values")
        return SCAN
    if role == "scan":
        return SCAN
    if role == "head":
        w = p.env[scan.states]
        return Seq(scan.out_dim, ONE, w.part, w.block)
    raise Mixes("the state after a scan's last block read (it depends on every chunk)")


def _one_hot(p: _Prover, n: fx.Node) -> Any:
    """``one_hot(x, C)``: a vector per entry, with C classes given (counted from the data, C
    would depend on every token)."""
    classes = n.args[1] if len(n.args) > 1 else n.kwargs.get("num_classes", -1)
    if not isinstance(classes, int) or classes <= 0:
        raise Mixes("a one-hot whose number of classes is counted from the data")
    return p._carry(n)


_VIEWS = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.view_as.default,
    aten.reshape_as.default,
)
_SPECIAL: dict[Any, Callable[[_Prover, fx.Node], Any]] = {
    aten.repeat.default: _repeat,
    aten.repeat_interleave.self_int: _repeat_interleave,
    aten.einsum.default: _einsum,
    aten.one_hot.default: _one_hot,
    aten.expand.default: _expand,
    **dict.fromkeys(
        (
            aten.zeros.default,
            aten.ones.default,
            aten.full.default,
            aten.empty.memory_format,
            aten.empty.default if hasattr(aten.empty, "default") else aten.empty.memory_format,
            aten.new_zeros.default,
            aten.new_ones.default,
            aten.new_full.default,
            aten.new_empty.default,
            aten.scalar_tensor.default,
        ),
        _factory,
    ),
    aten.arange.default: _arange,
    aten.arange.start: _arange,
    aten.arange.start_step: _arange,
    aten.cumsum.default: _cumsum,
    **dict.fromkeys(_CARRIED_SCANS, _carried_scan),
    **dict.fromkeys(CONVS, _convolution),
    **dict.fromkeys(_PADS, _padding),
    SDPA: _attention,
    LINEAR_SCAN: _linear_scan,
    aten.cross_entropy_loss.default: _loss,
    aten.sum.dim_IntList: _sum_all,
    aten.sum.default: _sum_all,
    **dict.fromkeys(_VIEWS, _view),
}

# the rules above that take a scan's blocks of the sequence (the others need tokens)
_BLOCK_RULES = frozenset(
    (
        aten.expand.default,  # of a scan's blocks: a rearrangement that keeps them (_expand)
        aten.einsum.default,
        aten.sum.dim_IntList,
        aten.sum.default,
        aten.cumsum.default,
        *_PADS,
        *_VIEWS,
    )
)

_LINEAR_ON_SUMS = frozenset(
    {
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.neg.default,
        aten._to_copy.default,
        aten.to.dtype,
        aten.clone.default,
    }
)

# where the sequence length may appear: as a size
SIZE_ARGS: dict[Any, tuple[int, ...]] = {
    aten.view.default: (1,),
    aten.reshape.default: (1,),
    aten._unsafe_view.default: (1,),
    aten.expand.default: (1,),
    aten.unflatten.int: (2,),
    aten.zeros.default: (0,),
    aten.ones.default: (0,),
    aten.empty.memory_format: (0,),
    aten.full.default: (0,),
    aten.new_zeros.default: (1,),
    aten.new_ones.default: (1,),
    aten.new_empty.default: (1,),
    aten.new_full.default: (1,),
    aten.slice.Tensor: (3,),
    aten.arange.default: (0,),
    aten.arange.start: (0, 1),
    aten.arange.start_step: (0, 1),
    aten.split_with_sizes.default: (1,),
    aten.repeat.default: (1,),
}
_SIZE_KW = frozenset({"size"})

_SYM_OPS = frozenset(
    {
        aten.sym_size.int,
        aten.sym_numel.default,
        operator.add,
        operator.sub,
        operator.mul,
        operator.floordiv,
        operator.truediv,
        operator.mod,
        operator.neg,
        operator.eq,
        operator.ne,
        operator.lt,
        operator.le,
        operator.gt,
        operator.ge,
        torch.sym_max,
        torch.sym_min,
        torch.sym_float,
        torch.sym_int,
        torch.sym_not,
        math.ceil,
        math.floor,
    }
)


# -- rows of the batch: the same proof with the batch in the sequence's place ------------------


def rows_mixed(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """The nodes of a whole captured graph that mix rows of the batch, each with how: the
    sequence proof above run with the batch size in the sequence length's place (the graph's
    symbols swapped while it runs), where no construct may carry anything from one row to the
    next (attention, convolutions and recurrences work within a row; an arange over the batch
    or a running count along it restarts on every rank) and only the summed loss adds rows up.
    A plan that splits the batch (dp, micro-batches) computes what one device does only on a
    graph with none: each rank's rows are a batch of their own."""
    names = gm.meta.get(META_SYMBOLS, {})
    b = next((v for v in names.values() if v.name == "b"), None)
    swapped = {k: S if v == b else b if v == S and b is not None else v for k, v in names.items()}
    gm.meta[META_SYMBOLS] = swapped
    try:
        # (rows, length) in the (b, s) slots: the batch grows from 3 to 5 rows
        _, found = _Prover(gm, ((48, 3), (48, 5), (96, 5)), rows=True).run()
    finally:
        gm.meta[META_SYMBOLS] = names
    return [(n, _rows_sentence(why)) for n, why in found]


def _rows_sentence(why: str) -> str:
    """A finding of the proof in the sequence's words, in the batch's."""
    why = why.removesuffix(" mixes tokens of different chunks")
    why = why.replace(
        " has no sequence rule (nothing proves it keeps the chunks' tokens apart)",
        " has no batch rule (nothing proves it keeps the rows apart)",
    )
    for old, new in (
        ("the sequence length", "the batch size"),
        ("the sequence", "the batch"),
        ("sized by the sequence", "sized by the batch"),
        ("tokens with tokens", "rows with rows"),
        ("tokens", "rows"),
        ("token", "row"),
        ("each chunk has its own", "each rank has its own"),
    ):
        why = why.replace(old, new)
    return why


def _ancestors(gm: fx.GraphModule) -> set[fx.Node]:
    """Every node the outputs need (masks included)."""
    live: set[fx.Node] = set()
    stack = [n for n in gm.graph.nodes if n.op == "output"]
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    return live


def _rows_attention(p: _Prover, n: fx.Node) -> Any:
    """SDPA within each row: the batch in one dim before the query and key dims, the same one
    (from the right) in q, k, v and the mask."""
    q = node_arg(n, 0)
    want = None
    for x in n.all_input_nodes:
        v = p.env.get(x)
        if not isinstance(v, Seq):
            continue
        from_right = _ndim(x) - v.dim % _ndim(x)
        if from_right <= 2 or v.inner != ONE or want not in (None, from_right):
            raise Mixes("an attention across rows of the batch")
        want = from_right
    if want is not None and want > _ndim(q):
        raise Mixes("an attention across rows of the batch")
    return p._carry(n)


@dataclass(frozen=True)
class RowIndex:
    """``arange(b)``, the rows' own indices, with ``dim`` its b-sized dim (unsqueezed or
    expanded): each rank's are 0 … its b − 1, so it may only index its own rows (Hugging Face's
    masks read ``attention_mask[batch_idx, kv_idx]``)."""

    dim: int


_ROW_INDEX_SHAPES = frozenset(
    (
        aten.unsqueeze.default,
        aten.expand.default,
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.slice.Tensor,
        aten.clone.default,
        aten._to_copy.default,
        aten.to.dtype,
        aten.to.dtype_layout,
    )
)


def _rows_arange(p: _Prover, n: fx.Node) -> Any:
    v = _arange(p, n)
    if isinstance(v, Seq) and n.target != aten.arange.default and n.args[0] != 0:
        raise Mixes("an arange over the batch size from another start than 0")
    return RowIndex(0) if isinstance(v, Seq) else v


def _row_index(p: _Prover, n: fx.Node) -> Any:
    """A rearrangement of the rows' indices that keeps them whole and in order (one dim of b,
    the rest of size 1 or broadcast); or ``aten.index`` of a value's rows by them."""
    if n.target == aten.index.Tensor:
        return _rows_indexed(p, n)
    x = node_arg(n, 0)
    val, src = n.meta.get("val"), x.meta.get("val")
    src_dim = cast(RowIndex, p.env[x]).dim
    grow = p.growing(val)
    if not (
        _is_tensor(val) and _is_tensor(src) and len(grow) == 1 and n.target in _ROW_INDEX_SHAPES
    ):
        raise Mixes("an arange over the batch size used other than as the rows' own index")
    whole = n.target != aten.slice.Tensor or whole_slice(n)
    # a view keeps the order of the indices only when nothing was broadcast beside them yet
    alone = n.target not in _VIEWS or all(d == 1 for i, d in enumerate(src.shape) if i != src_dim)
    same = p.at(val.shape[grow[0]]) == p.at(src.shape[src_dim])
    if whole and alone and same and n.all_input_nodes == [x]:
        return RowIndex(grow[0])
    raise Mixes("an arange over the batch size used other than as the rows' own index")


def _rows_indexed(p: _Prover, n: fx.Node) -> Any:
    """``x[..., rows, ...]`` with the rows' own indices at x's batch dim and no other index
    depending on the rows: row i reads row i."""
    x, idx = node_arg(n, 0), seq_arg(n, 1)
    v = p.env.get(x)
    if not isinstance(v, Seq) or v.inner != ONE or v.dim >= len(idx):
        raise Mixes("an index by the rows' own indices into a value not laid out by rows")
    for i, t in enumerate(idx):
        w = p.env.get(t) if isinstance(t, fx.Node) else None
        if (i == v.dim) != isinstance(w, RowIndex) or (i != v.dim and w is not None):
            raise Mixes("an index of the batch dim by other than the rows' own indices")
    grow = p.growing(n.meta["val"])
    if len(grow) != 1:
        raise Mixes("an index by the rows' own indices that moves the rows")
    return Seq(grow[0], ONE)


def _rows_scan(p: _Prover, n: fx.Node) -> Any:
    dim = int_arg(n, 2)
    return _carry_unless_along(
        p,
        n,
        [(node_arg(n, i), [dim], "a recurrence along the batch") for i in (0, 1)],
    )


_ROWS: dict[Any, Callable[[_Prover, fx.Node], Any]] = {
    SDPA: _rows_attention,
    aten.arange.default: _rows_arange,
    aten.arange.start: _rows_arange,
    aten.arange.start_step: _rows_arange,
    aten.cumsum.default: lambda p, n: _carry_unless_along(p, n, _scan("cumsum")(n)),
    **dict.fromkeys(_CARRIED_SCANS, _rows_carried_scan),
    **dict.fromkeys(_PADS, lambda p, n: _carry_unless_along(p, n, _pad(n))),
    LINEAR_SCAN: _rows_scan,
}


# -- helpers -----------------------------------------------------------------------------------


def live_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes the outputs need, once the chunk pass has replaced every causal attention's
    mask (the construction of a mask it drops is never run)."""
    live: set[fx.Node] = set()
    stack = [n for n in gm.graph.nodes if n.op == "output"]
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        if n.target == SDPA and n.meta.get(META_ATTENTION) == "causal":
            stack.extend(a for a in n.args[:3] if isinstance(a, fx.Node))
        elif is_scored(n):
            stack.extend(scored_qkv(n))
        else:
            stack.extend(n.all_input_nodes)
    return live


def is_scored(n: fx.Node) -> bool:
    """The product with v of a causal general-form attention (``canonicalize_attention``)."""
    return n.meta.get(META_SCORES) == "pv" and n.meta.get(META_ATTENTION) == "causal"


def scored_qkv(pv: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """q, k, v of a general-form attention, from its product with v: back through the nodes
    marked "mod" to the one marked "qk" (q·kᵀ)."""
    n = node_arg(pv, 0)
    while n.meta.get(META_SCORES) != "qk":
        n = next(a for a in n.all_input_nodes if a.meta.get(META_SCORES) in ("mod", "qk"))
    return node_arg(n, 0), node_arg(node_arg(n, 1), 0), node_arg(pv, 1)


def _is_softmax(n: fx.Node) -> bool:
    return n.target in (aten.softmax.int, aten._softmax.default)


def _is_tensor(v: Any) -> TypeGuard[torch.Tensor]:
    return isinstance(v, torch.Tensor)


def _is_tensor_list(x: Any) -> bool:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return isinstance(val, (list, tuple)) and any(_is_tensor(v) for v in val)


def _rows(v: Any) -> TypeGuard[Routed]:
    return isinstance(v, Routed) and v.kind == "rows"


def _ndim(x: Any) -> int:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return max(val.dim(), 1) if _is_tensor(val) else 1


def _flat(xs: Any) -> list[Any]:
    out = []
    for x in xs if isinstance(xs, (list, tuple)) else [xs]:
        out.extend(_flat(x) if isinstance(x, (list, tuple)) else [x])
    return out


def _op_name(target: Any) -> str:
    name = getattr(target, "_name", None) or getattr(target, "__name__", str(target))
    return str(name).replace("::", ".")


__all__ = [
    "LENGTH",
    "rows_mixed",
    "MIXED",
    "SOFTMAX",
    "SUMMED",
    "CONVS",
    "CarriedScan",
    "CausalConv",
    "Mixes",
    "Routed",
    "Seq",
    "TokenShift",
    "carried_scan",
    "causal_conv",
    "fill_value",
    "filled_with",
    "is_positions",
    "live_nodes",
    "seq_dims",
    "token_shift",
]
