"""Simulate a training iteration: the schedule IR, timed by a performance model of a GPU cluster.

Two layers:

- ``simulate_actions(actions_by_rank, cost_fn, comm_fn)``: an event simulator over any per-rank
  action lists (``autopart.schedule``). Each rank runs its actions in order. ``F``/``B`` take
  ``cost_fn(action)`` seconds. A ``SEND`` does not block (the runtime's ``isend``): its message
  arrives ``comm_fn(action)`` seconds later. A ``RECV`` waits for that arrival. ``DP_REDUCE``
  waits for the rank's gradient reductions, which start when each stage's last backward
  starts and run one after another on one stream; ``TIE_REDUCE`` is an all-reduce of every
  rank that has one. Returns a ``Timeline`` (events, span, per-rank busy and waiting times).
- ``simulate(shape, cluster, plan)``: a GPT shape (``GPTShape``), a ``Cluster`` (hardware and
  attention kernel) and an ``autopart.Plan`` (mesh, schedule, micro-batches, recompute, ...) → per-action costs from the
  performance model (``CostModel``) → ``simulate_actions`` over the actions ``generate`` gives
  (the same generators the runtime uses) → a ``Simulation`` with iteration time, tokens/s,
  TFLOP/s per GPU, MFU, bubble fraction, memory per GPU and a time breakdown.

One pipeline (pp ranks) is simulated: every dp and tp replica runs the same program at the same
speed. docs/simulate.md states the model, its constants and what every output counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple

from autopart.errors import AutopartError
from autopart.layout import Plan
from autopart.planning.cluster import GIB, Cluster, load_cluster
from autopart.runtime.timeline import chrome_event
from autopart.schedule.generators import generate
from autopart.schedule.ir import Action

VOCAB_MULTIPLE = 128  # Megatron pads the vocabulary to a multiple of 128 · tp

# --------------------------------------------------------------------------------------------
# the model


@dataclass(frozen=True)
class GPTShape:
    """A GPT: pre-norm blocks of attention (``heads`` query heads, ``kv_heads`` K/V heads) and a
    two-matrix MLP of width ``ffn`` (default 4·hidden), learned positions, LayerNorms with bias,
    and (``tied``) an LM head sharing the token embedding. ``seq`` is the training length."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    ffn: int | None = None
    tied: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "vocab", "seq"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AutopartError(f"model {f}={value!r} must be a positive integer")
        if self.hidden % self.heads:
            raise AutopartError(
                f"hidden {self.hidden} is not divisible by heads {self.heads}",
                hint="the head width is hidden / heads",
            )
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise AutopartError(f"kv_heads={self.kv_heads} must divide heads={self.heads}")
        if self.ffn is not None and self.ffn < 1:
            raise AutopartError(f"ffn={self.ffn} must be positive")

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv heads × head width."""
        return self.kv * self.head_dim

    @property
    def ffn_width(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def layer_matmul_params(self) -> int:
        h = self.hidden
        return h * (h + 2 * self.kv_dim) + h * h + 2 * h * self.ffn_width

    @property
    def layer_params(self) -> int:
        """Matmul weights, their biases and two LayerNorms (weight and bias)."""
        h = self.hidden
        return self.layer_matmul_params + (h + 2 * self.kv_dim) + h + self.ffn_width + h + 4 * h

    @property
    def params(self) -> int:
        h = self.hidden
        head = 0 if self.tied else self.vocab * h
        return self.layers * self.layer_params + self.vocab * h + self.seq * h + 2 * h + head

    def describe(self) -> str:
        kv = f", {self.kv_heads} kv heads" if self.kv_heads not in (None, self.heads) else ""
        return (
            f"{self.name + ': ' if self.name else ''}{self.params / 1e9:.1f} B parameters, "
            f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads{kv}, "
            f"ffn {self.ffn_width}, vocabulary {self.vocab}, sequence {self.seq}"
        )


SHAPES: dict[str, GPTShape] = {
    # Brown et al. 2020, Table 2.1 (GPT-3 175B), vocabulary of GPT-2's BPE
    "gpt3-175b": GPTShape(96, 12288, 96, 50257, 2048, name="gpt3-175b"),
    # Narayanan et al. 2021 (Megatron-LM, SC21), Table 1, the 1T row
    "megatron-1t": GPTShape(128, 25600, 160, 51200, 2048, name="megatron-1t"),
    # the 7B-shaped GPT of examples/gpt7b.py
    "gpt-7b": GPTShape(32, 4096, 32, 50304, 2048, name="gpt-7b"),
}


def shape_from_captured(captured: Any, seq: int | None = None) -> GPTShape:
    """The ``GPTShape`` of a captured GPT (``autopart.capture``), read from its graph.

    Layers: the transformer blocks; vocabulary and hidden: the largest embedding table;
    heads (and kv heads): the first attention's query and key; ffn: solved from block 0's matmul
    FLOPs per token, so a gated MLP counts as the two-matrix MLP with the same FLOPs.
    """
    import sympy

    from autopart.frontend.capture import META_LAYER, B, S
    from autopart.frontend.cost import analyze

    gm = captured.graph
    groups = analyze(captured)
    blocks = [g for g in groups if g.layer is not None]
    if not blocks:
        raise AutopartError(
            "the captured model has no transformer blocks (autopart.layer)",
            hint="simulate a GPT: blocks under a ModuleList, e.g. transformer.h.0",
        )
    vocab = hidden = 0
    heads = kv_heads = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if name.startswith("embedding") and node.args and hasattr(node.args[0], "meta"):
            weight = node.args[0].meta.get("val")
            if weight is not None and weight.dim() == 2 and int(weight.shape[0]) > vocab:
                vocab, hidden = int(weight.shape[0]), int(weight.shape[1])
        if not heads and node.meta.get(META_LAYER) is not None:
            if "scaled_dot_product" in name:
                q = node.args[0].meta["val"]
                heads = int(q.shape[-3])
                kv_heads = _kv_heads(node, heads, int(q.shape[-1]))
            elif name.startswith(("matmul", "bmm")) and node.meta["val"].dim() == 4:
                q, k = node.args[0].meta["val"], node.args[1].meta["val"]
                if str(k.shape[-1]) == str(q.shape[-2]):  # q @ kᵀ: (b, h, s, d) @ (b, h, d, s)
                    heads = kv_heads = int(q.shape[-3])
    if not vocab or not heads:
        raise AutopartError(
            "could not read the embedding table or the attention heads",
            hint="give the shape instead: --layers --hidden --heads --vocab --seq",
        )
    c1 = sympy.Poly(sympy.expand(blocks[0].cost.mm_flops.subs(B, 1)), S).coeff_monomial(S)
    d = hidden // heads
    attn = hidden * (hidden + 2 * kv_heads * d) + hidden * hidden
    ffn = max(1, round((float(c1) / 2 - attn) / (2 * hidden)))
    return GPTShape(
        layers=len({g.layer for g in blocks}),
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        seq=seq or captured.example_shape[1],
        kv_heads=kv_heads,
        ffn=ffn,
        tied=bool(captured.tied),
        name="captured",
    )


_PROJECTIONS = ("linear", "addmm", "mm", "matmul")


def _kv_heads(sdpa: Any, heads: int, d: int) -> int:
    """K/V heads of an attention: the width of the projection its keys come from (the graph
    may repeat grouped K/V heads before SDPA, so the key's own head count can overstate it)."""
    q_src, k_src = _projection(sdpa.args[0]), _projection(sdpa.args[1])
    if k_src is None:
        return int(sdpa.args[1].meta["val"].shape[-3])
    width = int(k_src.meta["val"].shape[-1])
    if k_src is q_src:  # fused QKV: width = h + 2·kv·d
        return max(1, (width - heads * d) // (2 * d))
    return max(1, width // d)


def _projection(node: Any, depth: int = 12) -> Any:
    """The nearest matmul with a 2-D weight above ``node`` (breadth first), or None."""
    frontier, seen = [node], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n in seen or not hasattr(n, "op"):
                continue
            seen.add(n)
            name = getattr(n.target, "__name__", str(n.target)) if n.op == "call_function" else ""
            if name.split(".")[0] in _PROJECTIONS and any(
                a.op == "placeholder" and getattr(a.meta.get("val"), "dim", lambda: 0)() == 2
                for a in n.all_input_nodes
            ):
                return n
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return None


# --------------------------------------------------------------------------------------------
# the performance model

_TILE = 128  # output tile of a tensor-core GEMM (wave quantization)


def _gemm(cl: Cluster, m: float, k: float, n: float, batch: float = 1) -> float:
    """Seconds of a (batched) bf16 GEMM (m × k) · (k × n): the slower of its math at
    ``mm_efficiency`` of peak, scaled by the share of the last wave of tiles the SMs fill, and
    its HBM traffic; plus one kernel launch."""
    tiles = batch * math.ceil(m / _TILE) * math.ceil(n / _TILE)
    waves = math.ceil(tiles / cl.sms)
    eff = cl.mm_efficiency * tiles / (waves * cl.sms)
    t_math = 2 * batch * m * k * n / (cl.peak_tflops * 1e12 * eff)
    t_mem = 2 * batch * (m * k + k * n + m * n) / (cl.hbm_tbps * 1e12 * cl.hbm_efficiency)
    return max(t_math, t_mem) + cl.kernel_launch_us * 1e-6


def _gemm_fb(cl: Cluster, m: float, k: float, n: float, batch: float = 1) -> tuple[float, float]:
    """(forward, backward) of C = A·B: backward is dA = dC·Bᵀ and dB = Aᵀ·dC."""
    return _gemm(cl, m, k, n, batch), _gemm(cl, m, n, k, batch) + _gemm(cl, k, m, n, batch)


def _mem(cl: Cluster, nbytes: float, kernels: int) -> float:
    """Seconds of memory-bound kernels moving ``nbytes`` through HBM."""
    return nbytes / (cl.hbm_tbps * 1e12 * cl.hbm_efficiency) + kernels * cl.kernel_launch_us * 1e-6


def _allreduce(n: int, nbytes: float, link: tuple[str, float, float]) -> float:
    """Ring all-reduce: 2(n−1)/n of the bytes over the link, 2(n−1) latency steps."""
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / link[1] + 2 * (n - 1) * link[2]


def _gather(n: int, nbytes: float, link: tuple[str, float, float]) -> float:
    """Ring all-gather or reduce-scatter of ``nbytes`` (the whole tensor): half an all-reduce."""
    return 0.0 if n == 1 else (n - 1) / n * nbytes / link[1] + (n - 1) * link[2]


class UnitCost(NamedTuple):
    """Seconds and bytes of one (layer or embedding or head) × one micro-batch chunk."""

    f: float  # forward compute
    f_tp: float  # forward tensor-parallel collectives (on the critical path)
    b: float  # backward compute, recompute included
    b_tp: float
    act: float  # activation bytes held from the forward until the backward
    transient: float  # extra bytes live during the backward (full recompute: one layer's)
    recompute: float  # the part of ``b`` that is recomputation


@lru_cache(maxsize=65536)
def _layer(
    shape: GPTShape,
    cl: Cluster,
    tp: int,
    sp: bool,
    recompute: str,
    attention: str,
    b: int,
    a: int,
    L: int,
) -> UnitCost:
    """One transformer layer on ``b`` sequences' tokens [a, a + L) (a > 0: a Seq1F1B chunk
    attending to a prefix of a tokens)."""
    h, f, kvd, d = shape.hidden, shape.ffn_width, shape.kv_dim, shape.head_dim
    T, t, heads = b * L, tp, shape.heads // tp
    r = 1 / t if sp else 1.0  # share of the replicated activations this GPU holds
    gemms = [
        _gemm_fb(cl, T, h, (h + 2 * kvd) / t),
        _gemm_fb(cl, T, h / t, h),
        _gemm_fb(cl, T, h, f / t),
        _gemm_fb(cl, T, f / t, h),
    ]
    if attention == "flash":
        # one fused causal kernel (FlashAttention-2, bottom-right causal for a chunk): the
        # 4·d FLOPs per (query, key) pair below the diagonal at attn_efficiency of peak; its
        # backward recomputes the scores (5 matmuls against 2): 2.5 × the forward
        scores = 0  # nothing of size L × (a + L) is stored
        flops = 4 * b * heads * d * (L * a + L * L / 2)
        attn_f = flops / (cl.peak_tflops * 1e12 * cl.attn_efficiency) + cl.kernel_launch_us * 1e-6
        attn_b = 2.5 * attn_f
    else:
        # unfused (Megatron 2021): scores Q·Kᵀ over the whole [L, a + L] block, masked, a fused
        # scale-mask-softmax (read + write bf16), dropout (read + write + a 1-byte mask)
        scores = b * heads * L * (a + L)
        attn_mm = [_gemm_fb(cl, L, d, a + L, b * heads), _gemm_fb(cl, L, a + L, d, b * heads)]
        attn_f = sum(x[0] for x in attn_mm) + _mem(cl, 9 * scores, 2)
        attn_b = sum(x[1] for x in attn_mm) + _mem(cl, 18 * scores, 2)
    # LayerNorms, bias + dropout + residual (7 bytes/element), bias + GeLU on the MLP width
    elem = T * (22 * h * r + 4 * f / t)
    fwd = sum(x[0] for x in gemms) + attn_f + _mem(cl, elem, 6)
    bwd = sum(x[1] for x in gemms) + attn_b + _mem(cl, 2 * elem, 8)
    if t > 1:
        link = cl.link(t)
        if sp:
            comm = 2 * (_gather(t, 2 * T * h, link) + _gather(t, 2 * T * h, link))
        else:
            comm = 2 * _allreduce(t, 2 * T * h, link)
    else:
        comm = 0.0
    f_tp = b_tp = comm
    # activations (Korthikanti et al. 2022, §4), bytes per token per layer, generalized to the
    # kv width and the ffn: 14h + 4·kvd + 4·ffn (= 34h for a standard GPT), of which LayerNorm
    # inputs, the QKV and fc1 inputs and two dropout masks (10h) stay whole without SP
    split = 4 * h + 4 * kvd + 4 * f
    per_token = (14 * h + 4 * kvd + 4 * f) / t if sp else 10 * h + split / t
    act_all = T * per_token + 5 * scores  # softmax output, its dropout mask and output: 5 B each
    prefix_copy = 4 * b * a * kvd / t  # autopart's chunk saves [prefix; chunk] K and V again
    rec = 0.0
    transient = 0.0
    if recompute == "none":
        act = act_all + prefix_copy
    elif recompute == "selective":  # recompute the attention core in the backward
        act = act_all - 5 * scores + prefix_copy
        rec = attn_f if attention == "unfused" else 0.0  # flash recomputes inside its backward
    else:  # full: keep the layer input (and a chunk's K/V for the later chunks), redo forward
        act = T * 2 * h * r + (4 * T * kvd / t + prefix_copy if a or shape.seq > L else 0)
        rec = fwd
        b_tp += comm
        transient = act_all + prefix_copy
    return UnitCost(fwd, f_tp, bwd + rec, b_tp, act, transient, rec)


@lru_cache(maxsize=65536)
def _embed_head(
    shape: GPTShape, cl: Cluster, tp: int, sp: bool, b: int, L: int
) -> tuple[UnitCost, UnitCost]:
    """(embedding, final norm + LM head + cross entropy) on ``b × L`` tokens."""
    h, t, T = shape.hidden, tp, b * L
    V = _padded_vocab(shape.vocab, tp)
    r = 1 / t if sp else 1.0
    link = cl.link(t)
    # embedding: vocab-parallel lookup + position add + dropout; its output is all-reduced
    # (reduce-scattered under SP) over tp; the backward scatters the gradient into the table
    emb_tp_f = _gather(t, 2 * T * h, link) if sp else _allreduce(t, 2 * T * h, link)
    emb_tp_b = _gather(t, 2 * T * h, link) if sp else 0.0
    embed = UnitCost(
        _mem(cl, 6 * T * h, 2), emb_tp_f, _mem(cl, 6 * T * h, 2), emb_tp_b, T * h * r, 0.0, 0.0
    )
    # head: final LayerNorm, logits (T × V/t), vocab-parallel cross entropy in fp32 (one
    # all-gather of each rank's 3 × T statistics); SP all-gathers the head's input, without SP
    # its gradient is all-reduced in the backward
    mm_f, mm_b = _gemm_fb(cl, T, h, V / t)
    ce = 10 * T * V / t
    tp_f = (_gather(t, 2 * T * h, link) if sp else 0.0) + _gather(t, 12 * T * t, link)
    tp_b = _gather(t, 2 * T * h, link) if sp else _allreduce(t, 2 * T * h, link)
    head = UnitCost(
        mm_f + _mem(cl, ce + 4 * T * h * r, 4),
        tp_f,
        mm_b + _mem(cl, ce + 8 * T * h * r, 4),
        tp_b,
        T * (4 * h * r + 6 * V / t),
        0.0,
        0.0,
    )
    return embed, head


def _padded_vocab(vocab: int, tp: int) -> int:
    step = VOCAB_MULTIPLE * tp
    return -(-vocab // step) * step


@lru_cache(maxsize=4096)
def _chunks(c1: float, c2: float, seq: int, k: int, split: str, multiple: int) -> tuple[int, ...]:
    from autopart.schedule.chunks import chunk_lengths

    return tuple(chunk_lengths((c1, c2), seq, k, split, multiple))


def stage_layers(layers: int, stages: int) -> list[int]:
    """Blocks per pipeline stage: equal shares, any remainder to the inner stages first (the
    first stage also embeds, the last also runs the LM head)."""
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    order = [*range(1, stages - 1), stages - 1, 0] if stages > 2 else list(range(stages))
    for s in order[:extra]:
        counts[s] += 1
    return counts


def stage_params(shape: GPTShape, st: Plan) -> tuple[list[float], list[float]]:
    """(parameters of each stage, parameters of each pipeline rank) on one GPU: matmul
    weights and column-parallel biases split over tp, LayerNorms and row-parallel biases
    whole; the vocab-parallel embedding on stage 0, the final norm (and, when the head is
    on another rank or untied, its copy of the table) on the last stage."""
    p, t, h = st.pp, st.tp, shape.hidden
    n_stages = p * st.virtual_stages
    vocab = _padded_vocab(shape.vocab, t)
    col_bias = (h + 2 * shape.kv_dim) + shape.ffn_width
    split = shape.layer_matmul_params + col_bias
    per_layer = split / t + (shape.layer_params - split)
    stages, ranks = [], [0.0] * p
    for s, n_layers in enumerate(stage_layers(shape.layers, n_stages)):
        n = n_layers * per_layer
        if s == 0:
            n += vocab * h / t + shape.seq * h
        if s == n_stages - 1:
            n += 2 * h + (vocab * h / t if (not shape.tied or p > 1) else 0)
        stages.append(n)
        ranks[s % p] += n
    return stages, ranks


class CostModel:
    """Per-action seconds and bytes for one (shape, cluster, plan), for every rank of one
    pipeline (pipeline position r holds stages r, r + pp, …)."""

    def __init__(
        self,
        shape: GPTShape,
        cluster: Cluster,
        plan: Plan,
        memory: dict[tuple[int, int], tuple[int, int]] | None = None,
    ) -> None:
        plan.check_model(shape.layers, shape.heads, shape.kv, shape.ffn_width, shape.seq)
        self.shape, self.cluster, self.st = shape, cluster, plan
        # (stage, chunk) → (held, transient) activation bytes read off a compiled program's
        # graphs (planning/memory.py); None: the analytic formula of ``_layer``
        self.memory = memory
        st, cl = plan, cluster
        p, v, k, t = st.pp, st.virtual_stages, st.seq_chunks, st.tp
        self.n_stages = p * v
        self.layers = stage_layers(shape.layers, self.n_stages)
        self.vocab = _padded_vocab(shape.vocab, t)
        h = shape.hidden
        # chunk boundaries as autopart cuts them: forward FLOPs per sequence c1·s + c2·s²
        c1 = shape.layers * 2 * shape.layer_matmul_params + 2 * h * self.vocab
        c2 = shape.layers * 2 * h
        self.chunk_lengths = _chunks(
            float(c1), float(c2), shape.seq, k, st.seq_split, st.chunk_multiple
        )
        starts = [sum(self.chunk_lengths[:j]) for j in range(k)]
        b = st.micro_batch or 1
        layer = [
            _layer(shape, cl, t, st.sequence_parallel, st.recompute, cl.attention, b, a, L)
            for a, L in zip(starts, self.chunk_lengths, strict=True)
        ]
        ends = [_embed_head(shape, cl, t, st.sequence_parallel, b, L) for L in self.chunk_lengths]
        self.units: list[list[UnitCost]] = []  # [stage][chunk]
        rows: dict[tuple[int, bool, bool], list[UnitCost]] = {}
        for s in range(self.n_stages):
            kind = (self.layers[s], s == 0, s == self.n_stages - 1)
            if kind not in rows:
                row = []
                for j in range(k):
                    parts = [
                        UnitCost(*(kind[0] * x for x in layer[j]))._replace(
                            transient=layer[j].transient
                        )
                    ]
                    if kind[1]:
                        parts.append(ends[j][0])
                    if kind[2]:
                        parts.append(ends[j][1])
                    row.append(_sum_units(parts))
                rows[kind] = row
            self.units.append(rows[kind])
        # pipeline hand-over: the activation (each tp rank its sequence slice under SP)
        r = 1 / t if st.sequence_parallel else 1.0
        self.send_bytes = [2 * b * L * h * r for L in self.chunk_lengths]
        self._stride = st.dp * t  # global rank distance between pipeline neighbours
        self._stage_params, self.params = stage_params(shape, st)
        self.tied_ranks = shape.tied and p > 1

    # -- per-action costs (simulate_actions callbacks) ----------------------------------------

    def action_cost(self, a: Action) -> float:
        """Seconds of an F/B (tp collectives included), a stage's DP reduction, or TIE_REDUCE."""
        if a.kind == "F":
            u = self.units[a.stage][a.chunk]
            return u.f + u.f_tp
        if a.kind == "B":
            u = self.units[a.stage][a.chunk]
            return u.b + u.b_tp
        if a.kind == "DP_REDUCE":
            return self.dp_reduce_time(a.stage)
        if a.kind == "TIE_REDUCE":
            return self.tie_time()
        return 0.0

    def transfer(self, a: Action) -> float:
        """Seconds from a SEND's start until its message has arrived."""
        src = a.stage % self.st.pp
        dst = (a.stage + (1 if a.kind == "SEND_F" else -1)) % self.st.pp
        link = self.p2p_link(src, dst)
        return self.send_bytes[a.chunk] / link[1] + link[2]

    def p2p_link(self, i: int, j: int) -> tuple[str, float, float]:
        """The link between pipeline positions i and j, for the worst of the dp × tp
        pipelines: InfiniBand if any of their pairs sits on two nodes."""
        lo, hi = min(i, j), max(i, j)
        g = self.cluster.gpus_per_node
        first, last = lo * self._stride, (hi + 1) * self._stride - 1
        span = g + 1 if first // g != last // g else 1
        return self.cluster.link(span)

    def dp_reduce_time(self, stage: int) -> float:
        """Gradient reduction of one stage over dp: fp32 gradients (Megatron's main grads),
        all-reduced, or reduce-scattered with the distributed optimizer."""
        dp = self.st.dp
        if dp == 1:
            return 0.0
        nbytes = 4 * self._stage_params[stage]
        link = self.cluster.link(dp * self.st.tp)
        if self.st.distributed_optimizer:
            return _gather(dp, nbytes, link)
        return _allreduce(dp, nbytes, link)

    def tie_time(self) -> float:
        """All-reduce of the tied embedding's fp32 gradient between the first and last rank."""
        nbytes = 4 * self.vocab * self.shape.hidden / self.st.tp
        return _allreduce(2, nbytes, self.p2p_link(0, self.st.pp - 1))

    def optimizer_time(self, rank: int) -> float:
        """Adam step, memory-bound: read fp32 grad, master, m, v; write master, m, v and the
        bf16 parameter; the gradient norm reads the gradient again (34 bytes per parameter);
        with the distributed optimizer each dp rank updates 1/dp of them."""
        n = self.params[rank] / (self.st.dp if self.st.distributed_optimizer else 1)
        return _mem(self.cluster, 34 * n, 4)

    def param_gather_time(self, rank: int) -> float:
        """Distributed optimizer: all-gather of the updated bf16 parameters over dp."""
        if not self.st.distributed_optimizer or self.st.dp == 1:
            return 0.0
        return _gather(
            self.st.dp, 2 * self.params[rank], self.cluster.link(self.st.dp * self.st.tp)
        )

    # -- memory -------------------------------------------------------------------------------

    def static_bytes(self, rank: int) -> dict[str, float]:
        """Parameters (bf16), gradients (fp32) and Adam states (fp32 master, m, v) of a rank;
        Megatron's 18 bytes per parameter, or 6 + 12/dp with the distributed optimizer."""
        n = self.params[rank]
        opt = 12 * n / (self.st.dp if self.st.distributed_optimizer else 1)
        return {"parameters": 2 * n, "gradients": 4 * n, "optimizer": opt}

    def activation_peak(self, actions: list[Action], transient: bool = True) -> float:
        """Most activation bytes a rank holds: a unit's from its F until its B ends; during a B
        the unit's transient bytes (full recompute: one layer's activations) are live too
        (``transient=False``: only the held bytes, what ``Runner.peak_saved_bytes`` counts)."""
        held = peak = 0.0
        for a in actions:
            if a.kind in ("F", "B"):
                if self.memory is not None:
                    act, extra = self.memory[(a.stage, a.chunk)]
                else:
                    u = self.units[a.stage][a.chunk]
                    act, extra = u.act, u.transient
            if a.kind == "F":
                held += act
                peak = max(peak, held)
            elif a.kind == "B":
                peak = max(peak, held + (extra if transient else 0))
                held -= act
        return peak

    # -- FLOPs ------------------------------------------------------------------------------

    def model_flops(self) -> float:
        """Model FLOPs of one iteration, Megatron's count generalized to the kv width and ffn:
        3 × forward, forward = 2·(matmul weights)·tokens + 4·B·s²·h per layer (attention
        scores and their product with V over the whole s × s square) + 2·B·s·h·V (logits).
        A standard GPT gives 72·B·s·l·h²·(1 + s/6h + V/12lh)."""
        return 3 * self._forward_flops(layers=True, logits=True)

    def hardware_flops(self) -> float:
        """``model_flops`` plus what the recompute runs again: full, one more forward of every
        layer (96·B·s·l·h²·(1 + s/6h + V/16lh) for a standard GPT); selective with unfused
        attention, the attention core's 4·B·s²·h per layer (with flash attention the kernel's
        own backward recomputes the scores, which no count here includes)."""
        extra = 0.0
        if self.st.recompute == "full":
            extra = self._forward_flops(layers=True, logits=False)
        elif self.st.recompute == "selective" and self.cluster.attention == "unfused":
            sh = self.shape
            extra = 4 * self.st.global_batch * sh.seq**2 * sh.hidden * sh.layers
        return self.model_flops() + extra

    def _forward_flops(self, layers: bool, logits: bool) -> float:
        sh, B, s = self.shape, self.st.global_batch, self.shape.seq
        out = 0.0
        if layers:
            out += sh.layers * (2 * sh.layer_matmul_params * B * s + 4 * B * s * s * sh.hidden)
        if logits:
            out += 2 * B * s * sh.hidden * self.vocab
        return out


def _sum_units(parts: list[UnitCost]) -> UnitCost:
    total = UnitCost(*(sum(x) for x in zip(*parts, strict=True)))
    return total._replace(transient=max(p.transient for p in parts))


# --------------------------------------------------------------------------------------------
# the event simulator


class Event(NamedTuple):
    """One action's span on one rank (seconds from the iteration's start)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def name(self) -> str:
        return str(self.action)  # as Action.__str__ prints: F(s0,m1,c2), SEND_F(s0,m0)→r1

    @property
    def kind(self) -> str:
        return self.action.kind


@dataclass
class RankTimes:
    """What a rank's time went to (seconds)."""

    end: float = 0.0  # when its last action ended
    busy: float = 0.0  # F and B
    recv_wait: float = 0.0  # RECV waits, all of them
    recv_exposed: float = 0.0  # the part of each RECV wait no longer than its transfer
    dp_wait: float = 0.0  # DP_REDUCE waits
    tie_wait: float = 0.0  # TIE_REDUCE (start to end)

    def scaled(self, other: RankTimes, x: float) -> RankTimes:
        """self + x · (other − self), field by field (linear extrapolation)."""
        return RankTimes(
            *(a + x * (b - a) for a, b in zip(_astuple(self), _astuple(other), strict=True))
        )


def _astuple(rt: RankTimes) -> tuple[float, ...]:
    return (rt.end, rt.busy, rt.recv_wait, rt.recv_exposed, rt.dp_wait, rt.tie_wait)


@dataclass
class Timeline:
    """The result of ``simulate_actions``."""

    span: float  # from 0 to the last action's end, over all ranks
    ranks: dict[int, RankTimes]
    events: list[Event] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of (span − the rank's F and B time) / span."""
        if self.span <= 0:
            return 0.0
        return sum(self.span - rt.busy for rt in self.ranks.values()) / (
            len(self.ranks) * self.span
        )


_FB, _SEND, _RECV, _DP, _TIE = range(5)
_MATCH = {"RECV_F": "SEND_F", "RECV_B": "SEND_B"}


class _Compiled(NamedTuple):
    ranks: list[int]
    ops: list[list[tuple[int, int, int]]]  # per rank index: (code, cost key, message)
    keys: list[Action]  # a representative action per cost key
    is_send_key: list[bool]
    key_stage: list[int]
    n_msgs: int
    dp_keys: list[dict[int, int]]  # per rank index: stage → cost key of its DP reduction


def _compile(actions_by_rank: dict[int, list[Action]]) -> _Compiled:
    ranks = sorted(actions_by_rank)
    keys: dict[tuple, int] = {}
    reps: list[Action] = []
    is_send: list[bool] = []

    def key(k: tuple, a: Action, send: bool) -> int:
        if k not in keys:
            keys[k] = len(reps)
            reps.append(a)
            is_send.append(send)
        return keys[k]

    msgs: dict[tuple, int] = {}

    def msg(k: tuple) -> int:
        return msgs.setdefault(k, len(msgs))

    ops, dp_keys = [], []
    for r in ranks:
        row, stages = [], []
        for a in actions_by_rank[r]:
            kind = a.kind
            if kind in ("F", "B"):
                row.append((_FB, key((kind, a.stage, a.chunk), a, False), -1))
                if kind == "B" and a.stage not in stages:
                    stages.append(a.stage)
            elif kind in ("SEND_F", "SEND_B"):
                kk = key((kind, a.stage, a.chunk, r, a.peer), a, True)
                row.append((_SEND, kk, msg((kind, r, a.peer, a.stage, a.mb, a.chunk))))
            elif kind in _MATCH:
                stage = a.stage - 1 if kind == "RECV_F" else a.stage + 1
                row.append((_RECV, -1, msg((_MATCH[kind], a.peer, r, stage, a.mb, a.chunk))))
            elif kind == "DP_REDUCE":
                row.append((_DP, -1, -1))
            elif kind == "TIE_REDUCE":
                row.append((_TIE, key(("TIE",), a, False), -1))
            else:
                raise AutopartError(f"rank {r}: cannot simulate action {a}")
        ops.append(row)
        dp_keys.append({s: key(("DP", s), Action("DP_REDUCE", s), False) for s in stages})
    return _Compiled(ranks, ops, reps, is_send, [a.stage for a in reps], len(msgs), dp_keys)


def simulate_actions(
    actions_by_rank: dict[int, list[Action]],
    cost_fn: Callable[[Action], float],
    comm_fn: Callable[[Action], float] | None = None,
    record: bool = True,
) -> Timeline:
    """Time every rank's action list (see the module docstring for the rules).

    ``cost_fn(action)`` gives the seconds of an ``F`` or ``B``, of ``TIE_REDUCE``, and of the
    gradient reduction of one stage for ``Action("DP_REDUCE", stage)``; it is called once per
    distinct (kind, stage, chunk), so it may depend on nothing else. ``comm_fn(action)`` gives a
    ``SEND``'s transfer seconds (once per distinct kind, stage, chunk and peer); ``None`` means
    free communication. ``record=False`` skips the events (faster).
    """
    comp = _compile(actions_by_rank)
    comm_fn = comm_fn or (lambda a: 0.0)
    cost = [
        comm_fn(a) if s else cost_fn(a) for a, s in zip(comp.keys, comp.is_send_key, strict=True)
    ]
    return _run(comp, cost, actions_by_rank if record else None)


def _run(comp: _Compiled, cost: list[float], actions: dict[int, list[Action]] | None) -> Timeline:
    n = len(comp.ranks)
    now = [0.0] * n
    pc = [0] * n
    arrival: list[float | None] = [None] * comp.n_msgs
    xfer = [0.0] * comp.n_msgs
    waiter = [-1] * comp.n_msgs
    times = [RankTimes() for _ in range(n)]
    last_b: list[dict[int, tuple[float, float]]] = [{} for _ in range(n)]
    tie_at: dict[int, float] = {}
    tie_n = sum(1 for row in comp.ops if any(op[0] == _TIE for op in row))
    raw: list[tuple[int, int, float, float]] = []
    rec = actions is not None
    stage_of = comp.key_stage
    stack = list(range(n - 1, -1, -1))
    while stack:
        i = stack.pop()
        ops, t, p, rt = comp.ops[i], now[i], pc[i], times[i]
        end = len(ops)
        while p < end:
            code, key, m = ops[p]
            if code == _FB:
                d = cost[key]
                if rec:
                    raw.append((i, p, t, t + d))
                lb = last_b[i]
                lb[stage_of[key]] = (t, t + d)  # F entries are overwritten by later B's
                t += d
                rt.busy += d
            elif code == _SEND:
                arrival[m] = t + cost[key]
                xfer[m] = cost[key]
                if rec:
                    raw.append((i, p, t, t))
                w = waiter[m]
                if w >= 0:
                    waiter[m] = -1
                    stack.append(w)
            elif code == _RECV:
                at = arrival[m]
                if at is None:
                    waiter[m] = i
                    break
                start = t
                if at > t:
                    rt.recv_wait += at - t
                    rt.recv_exposed += min(at - t, xfer[m])
                    t = at
                if rec:
                    raw.append((i, p, start, t))
            elif code == _DP:
                comm = 0.0
                for s, (b0, b1) in sorted(last_b[i].items(), key=lambda kv: kv[1][0]):
                    comm = max(max(comm, b0) + cost[comp.dp_keys[i][s]], b1)
                done = max(t, comm)
                rt.dp_wait += done - t
                if rec:
                    raw.append((i, p, t, done))
                t = done
            else:  # _TIE: every rank that has one meets
                tie_at[i] = t
                if len(tie_at) < tie_n:
                    now[i], pc[i] = t, p
                    break
                done = max(tie_at.values()) + cost[key]
                for j, arrived in tie_at.items():
                    times[j].tie_wait += done - arrived
                    if rec:
                        raw.append((j, _index_of(comp.ops[j], _TIE), arrived, done))
                    if j != i:
                        now[j], pc[j] = done, _index_of(comp.ops[j], _TIE) + 1
                        stack.append(j)
                t = done
            p += 1
        now[i], pc[i] = t, p
    stuck = [(comp.ranks[i], pc[i]) for i in range(n) if pc[i] < len(comp.ops[i])]
    if stuck:
        raise AutopartError(
            "simulated schedule deadlocks: "
            + ", ".join(f"rank {r} waits at step {p}" for r, p in stuck[:4]),
            hint="check it with autopart.schedule.verify",
        )
    for i in range(n):
        times[i].end = now[i]
    span = max(now, default=0.0)
    events = []
    if rec:
        for i, p, s, e in raw:
            r = comp.ranks[i]
            events.append(Event(r, actions[r][p], s, e))
        events.sort(key=lambda ev: (ev.rank, ev.start))
    return Timeline(span, {comp.ranks[i]: times[i] for i in range(n)}, events)


def _index_of(ops: list[tuple[int, int, int]], code: int) -> int:
    return next(i for i, op in enumerate(ops) if op[0] == code)


def to_chrome_trace(events: list[Event]) -> list[dict[str, Any]]:
    """Events as Chrome/Perfetto trace events, in ``Runner.chrome_trace``'s format
    (``autopart.runtime.timeline.chrome_event``: the action's fields in ``args``)."""
    return [chrome_event(ev.action, ev.start, ev.end, ev.rank) for ev in events]


# --------------------------------------------------------------------------------------------
# simulate one iteration

EXACT_LIMIT = 400_000  # F and B actions in one pipeline above which ``simulate`` extrapolates


@dataclass
class Simulation:
    """One simulated iteration: ``summary`` is what ``autopart simulate --json`` prints."""

    shape: GPTShape
    cluster: Cluster
    plan: Plan
    costs: CostModel
    timeline: Timeline
    summary: dict[str, Any]

    @property
    def events(self) -> list[Event]:
        return self.timeline.events

    def chrome_trace(self) -> list[dict[str, Any]]:
        return to_chrome_trace(self.timeline.events)

    def to_json(self) -> dict[str, Any]:
        return self.summary


@lru_cache(maxsize=256)
def _actions(
    schedule: str, p: int, m: int, v: int, k: int, dp: bool, tied: bool
) -> dict[int, list[Action]]:
    peers = list(range(p))
    return {
        r: generate(
            schedule, r, m, peers, dp=2 if dp else 1, v=v, tied=tied and r in (0, p - 1), k=k
        )
        for r in range(p)
    }


@lru_cache(maxsize=256)
def _compiled(schedule: str, p: int, m: int, v: int, k: int, dp: bool, tied: bool) -> _Compiled:
    return _compile(_actions(schedule, p, m, v, k, dp, tied))


def simulate(
    shape: GPTShape,
    cluster: Cluster | str,
    plan: Plan,
    *,
    record: bool = True,
    extrapolate: bool | None = None,
    memory: dict[tuple[int, int], tuple[int, int]] | None = None,
) -> Simulation:
    """Simulate one iteration of ``plan`` for ``shape`` on ``cluster``.

    ``memory``: per-unit activation bytes of the compiled program
    (``planning.memory.graph_memory``) instead of the analytic formula.

    ``extrapolate``: simulate 2·pp and 3·pp micro-batches and extend linearly to the real
    number (the steady state repeats every pp micro-batches); ``None`` does so only when the
    pipeline has more than ``EXACT_LIMIT`` F and B actions. Extrapolated runs have no events.
    """
    return simulate_costs(
        CostModel(shape, load_cluster(cluster), plan, memory),
        record=record,
        extrapolate=extrapolate,
    )


def simulate_costs(
    costs: CostModel, *, record: bool = True, extrapolate: bool | None = None
) -> Simulation:
    """``simulate`` with a ready ``CostModel`` (the planner builds one per candidate)."""
    st = costs.st
    p, v, k, m = st.pp, st.virtual_stages, st.seq_chunks, st.microbatches
    if extrapolate is None:
        extrapolate = 2 * p * v * k * m > EXACT_LIMIT
    extrapolate = extrapolate and m > 3 * p
    key = (st.schedule, p, v, k, st.dp > 1, costs.tied_ranks)
    if extrapolate:
        runs = [_timed(costs, _compiled(key[0], p, mm, *key[2:]), None) for mm in (2 * p, 3 * p)]
        x = (m - 2 * p) / p
        span = runs[0].span + x * (runs[1].span - runs[0].span)
        ranks = {r: runs[0].ranks[r].scaled(runs[1].ranks[r], x) for r in runs[0].ranks}
        timeline = Timeline(span, ranks)
        acts = _actions(key[0], p, 3 * p, *key[2:])  # the peak is reached within 3·pp
    else:
        acts = _actions(key[0], p, m, *key[2:])
        timeline = _timed(costs, _compiled(key[0], p, m, *key[2:]), acts if record else None)
    summary = _summary(costs, timeline, acts, extrapolated=extrapolate)
    return Simulation(costs.shape, costs.cluster, st, costs, timeline, summary)


def _timed(costs: CostModel, comp: _Compiled, acts: dict[int, list[Action]] | None) -> Timeline:
    cost = [
        costs.transfer(a) if s else costs.action_cost(a)
        for a, s in zip(comp.keys, comp.is_send_key, strict=True)
    ]
    return _run(comp, cost, acts)


def _summary(
    costs: CostModel, tl: Timeline, acts: dict[int, list[Action]], extrapolated: bool
) -> dict[str, Any]:
    st, sh, cl = costs.st, costs.shape, costs.cluster
    p, m = st.pp, st.microbatches
    finish = {
        r: tl.ranks[r].end + costs.param_gather_time(r) + costs.optimizer_time(r) for r in range(p)
    }
    T = max(finish.values())
    cats = {
        "compute_s": 0.0,
        "tp_comm_s": 0.0,
        "pp_comm_s": 0.0,
        "dp_comm_s": 0.0,
        "optimizer_s": 0.0,
        "bubble_s": 0.0,
    }
    recompute = 0.0
    for r in range(p):
        comp = tp = rec = 0.0
        for s in range(r, costs.n_stages, p):
            for u in costs.units[s]:
                comp += m * (u.f + u.b)
                tp += m * (u.f_tp + u.b_tp)
                rec += m * u.recompute
        rt = tl.ranks[r]
        dp = rt.dp_wait + rt.tie_wait + costs.param_gather_time(r)
        opt = costs.optimizer_time(r)
        pp = rt.recv_exposed
        cats["compute_s"] += comp / p
        cats["tp_comm_s"] += tp / p
        cats["pp_comm_s"] += pp / p
        cats["dp_comm_s"] += dp / p
        cats["optimizer_s"] += opt / p
        cats["bubble_s"] += max(0.0, T - comp - tp - pp - dp - opt) / p
        recompute += rec / p
    hw, model = costs.hardware_flops(), costs.model_flops()
    gpus = st.gpus
    tflops = hw / T / gpus / 1e12
    mem = []
    for r in range(p):
        static = costs.static_bytes(r)
        act = costs.activation_peak(acts[r])
        mem.append(
            {
                **{k: v / GIB for k, v in static.items()},
                "activations": act / GIB,
                "saved_activations": costs.activation_peak(acts[r], transient=False) / GIB,
                "total": (sum(static.values()) + act) / GIB,
            }
        )
    worst = max(range(p), key=lambda r: mem[r]["total"])
    tokens = st.global_batch * sh.seq
    return {
        "iteration_s": T,
        "tokens_per_s": tokens / T,
        "tflops_per_gpu": tflops,
        "mfu": model / T / gpus / (cl.peak_tflops * 1e12),
        "hfu": tflops / cl.peak_tflops,
        "bubble_fraction": cats["bubble_s"] / T,
        "memory_gb_per_gpu": mem[worst]["total"],
        "fits": mem[worst]["total"] * GIB <= cl.usable_bytes,
        "memory": {
            "rank": worst,
            **mem[worst],
            "usable": cl.usable_bytes / GIB,
            "capacity": cl.hbm_gib,
            "per_rank_total": [x["total"] for x in mem],
            "per_rank_saved_activations": [x["saved_activations"] for x in mem],
            "activations_from": "formula" if costs.memory is None else "graph",
        },
        "breakdown": cats,
        "recompute_s": recompute,
        "flops_per_iteration": hw,
        "model_flops_per_iteration": model,
        "gpus": gpus,
        "microbatches": m,
        "stage_layers": costs.layers,
        "chunk_lengths": list(costs.chunk_lengths),
        "extrapolated": extrapolated,
        "plan": st.to_json(),
        "global_batch": st.global_batch,
        "model": {**asdict(sh), "params": sh.params, "padded_vocab": costs.vocab},
        "cluster": cl.name,
    }


def fast_lower_bound(costs: CostModel) -> float:
    """A lower bound on the iteration time, without simulating. For every pipeline rank r:

    - r starts after the first micro-batch's forwards on stages 0 … r−1 and then runs all its
      F and B: it ends its last backward at E_r or later;
    - then its gradient reduction of the stage of that backward still needs its time minus the
      backward's (it started with it), then the optimizer step (and the distributed
      optimizer's parameter all-gather);
    - the last micro-batch's backward still runs through stages r−1 … 0 after E_r, and rank 0
      then finishes the same way.

    Exact for equal stages and free communication (the closed forms); below the simulation
    otherwise, which makes the planner's branch and bound exact."""
    st = costs.st
    p, m = st.pp, st.microbatches

    def finish(r: int) -> float:
        u = costs.units[r][0]  # the rank's last backward: stage r (virtual chunk 0), chunk 0
        reduce = max(0.0, costs.dp_reduce_time(r) - (u.b + u.b_tp))
        return reduce + costs.optimizer_time(r) + costs.param_gather_time(r)

    best = prefix_f = prefix_b = 0.0
    for r in range(p):
        busy = sum(
            m * (u.f + u.f_tp + u.b + u.b_tp)
            for s in range(r, costs.n_stages, p)
            for u in costs.units[s]
        )
        end = prefix_f + busy
        best = max(best, end + finish(r), end + prefix_b + (finish(0) if r else 0.0))
        u0 = costs.units[r][0]
        prefix_f += u0.f + u0.f_tp
        prefix_b += u0.b + u0.b_tp
    return best


def breakdown_table(summary: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(category, seconds, share of the iteration) rows of a summary's breakdown."""
    T = summary["iteration_s"]
    return [
        (k.removesuffix("_s").replace("_", " "), v, v / T) for k, v in summary["breakdown"].items()
    ]


# --------------------------------------------------------------------------------------------
# command-line helpers (autopart simulate / autopart plan)


def resolve_shape(model: str | None = None, shape: str | None = None, **flags: Any) -> GPTShape:
    """The model of a command line: a SPEC to capture, a named shape, or the shape flags
    (``resolve_model``'s keywords)."""
    return resolve_model(model, shape, **flags)[0]


def resolve_model(
    model: str | None = None,
    shape: str | None = None,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    vocab: int | None = None,
    seq: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    tied: bool = True,
) -> tuple[GPTShape, Any]:
    """``resolve_shape``, and the captured model when ``model`` (a SPEC) names one, else None."""
    given = [x is not None for x in (layers, hidden, heads, vocab)]
    if sum(x is not None for x in (model, shape)) + (any(given) or 0) > 1:
        raise AutopartError("give one model: --model SPEC, --shape NAME or the shape flags")
    if model is not None:
        from autopart.frontend.capture import capture
        from autopart.frontend.spec import build

        net, batch = build(model)
        captured = capture(net, batch)
        return shape_from_captured(captured, seq), captured
    if shape is not None:
        if shape not in SHAPES:
            import difflib

            close = difflib.get_close_matches(shape, list(SHAPES), n=1)
            raise AutopartError(
                f"unknown model shape {shape!r}",
                hint=(f"did you mean {close[0]!r}? " if close else "")
                + f"shapes: {', '.join(SHAPES)}",
            )
        base = SHAPES[shape]
        return (base if seq is None else GPTShape(**{**asdict(base), "seq": seq})), None
    if not all(given) or seq is None:
        missing = [
            f"--{n}"
            for n, x in zip(
                ("layers", "hidden", "heads", "vocab", "seq"),
                (*given, seq is not None),
                strict=True,
            )
            if not x
        ]
        raise AutopartError(
            f"the model shape needs {', '.join(missing)}",
            hint="or --model SPEC (captured) or --shape megatron-1t",
        )
    return GPTShape(layers, hidden, heads, vocab, seq, kv_heads=kv_heads, ffn=ffn, tied=tied), None


def _gib(x: float) -> str:
    """GiB with a tenth, or MiB/KiB for a small model's activations (which would read 0.0)."""
    for unit, scale in (("GiB", 1), ("MiB", 2**10), ("KiB", 2**20)):
        if x * scale >= 0.95 or unit == "KiB":
            return f"{x * scale:.1f} {unit}"
    return ""


def print_summary(summary: dict[str, Any], console: Any) -> None:
    """A simulation's summary as rich tables."""
    from rich.table import Table

    plan = Plan.from_json(summary["plan"])
    mem = summary["memory"]
    head = Table(
        title=f"{plan.describe()} on {summary['gpus']} × {summary['cluster']}", show_header=False
    )
    head.add_column(justify="left")
    head.add_column(justify="right")
    rows = [
        (
            "iteration",
            f"{summary['iteration_s']:.3f} s"
            + (" (extrapolated)" if summary["extrapolated"] else ""),
        ),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}"),
        ("TFLOP/s per GPU (Megatron's count)", f"{summary['tflops_per_gpu']:.1f}"),
        ("MFU / HFU", f"{summary['mfu']:.1%} / {summary['hfu']:.1%}"),
        ("bubble", f"{summary['bubble_fraction']:.1%}"),
        (
            f"memory per GPU (rank {mem['rank']})",
            f"{mem['total']:.1f} GiB of {mem['usable']:.1f} usable"
            + ("" if summary["fits"] else "  [red]does not fit[/red]"),
        ),
        (
            "  parameters / gradients / optimizer",
            f"{mem['parameters']:.1f} / {mem['gradients']:.1f} / {mem['optimizer']:.1f} GiB",
        ),
        (
            "  activations"
            + (" (read off the compiled graphs)" if mem["activations_from"] == "graph" else ""),
            _gib(mem["activations"]),
        ),
    ]
    for k, v in rows:
        head.add_row(k, v)
    console.print(head)
    table = Table(title="where the time goes (mean over pipeline ranks)")
    for col in ("", "seconds", "share"):
        table.add_column(col, justify="right" if col else "left")
    for name, sec, share in breakdown_table(summary):
        table.add_row(name, f"{sec:.3f}", f"{share:.1%}")
    console.print(table)


__all__ = [
    "SHAPES",
    "CostModel",
    "Event",
    "GPTShape",
    "RankTimes",
    "Simulation",
    "Timeline",
    "breakdown_table",
    "print_summary",
    "resolve_shape",
    "fast_lower_bound",
    "simulate_costs",
    "shape_from_captured",
    "simulate",
    "simulate_actions",
    "stage_layers",
    "to_chrome_trace",
]
