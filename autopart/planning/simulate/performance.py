"""The performance model: seconds and bytes of each action of one (shape, cluster, plan), for
every rank of one pipeline (``CostModel``), from GEMM, memory-bound, collective and point-to-point
costs of the cluster profile (docs/simulate.md, "The performance model")."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

from autopart.layout import Plan
from autopart.planning.cluster import Cluster
from autopart.planning.simulate.shape import GPTShape
from autopart.planning.simulate.speed import DEDICATED, SpeedModel
from autopart.schedule.chunks import chunk_lengths
from autopart.schedule.generators import traits
from autopart.schedule.ir import Action

VOCAB_MULTIPLE = 128  # Megatron pads the vocabulary to a multiple of 128 · tp


_TILE = 128  # output tile of a tensor-core GEMM (wave quantization)


def _gemm(
    cl: Cluster, m: float, k: float, n: float, batch: float = 1, weight: bool = False
) -> float:
    """Seconds of a (batched) bf16 GEMM (m × k) · (k × n): the slower of its math and its HBM
    traffic, plus one kernel launch. The math runs at ``mm_efficiency`` of peak, scaled by the
    share of the last wave of output tiles the SMs fill and by k / (k + ``mm_k_overhead``): each
    tile's fixed prologue and epilogue cost as much as ``mm_k_overhead`` more steps of its inner
    loop, which a short inner dimension (a tp-split projection, an attention head) cannot hide.
    ``weight``: the (k × n) operand is a weight, which a cluster with ``mm_weight_gbps`` reads
    at that rate on top of the rest (a CPU GEMM packs it from memory every call)."""
    tiles = batch * math.ceil(m / _TILE) * math.ceil(n / _TILE)
    waves = math.ceil(tiles / cl.sms)
    eff = cl.mm_efficiency * tiles / (waves * cl.sms) * k / (k + cl.mm_k_overhead)
    t_math = 2 * batch * m * k * n / (cl.peak_tflops * 1e12 * eff)
    t_mem = (
        cl.act_bytes * batch * (m * k + k * n + m * n) / (cl.hbm_tbps * 1e12 * cl.hbm_efficiency)
    )
    packed = _cold_read(cl, batch * k * n) if weight else 0.0
    return max(t_math, t_mem) + packed + cl.kernel_launch_us * 1e-6


def _cold_read(cl: Cluster, elements: float) -> float:
    """Seconds to read ``elements`` values from memory at ``mm_weight_gbps``, on top of the
    math (a CPU GEMM's weight, a deferred W's operands); 0 without it (GPUs)."""
    return cl.act_bytes * elements / (cl.mm_weight_gbps * 1e9) if cl.mm_weight_gbps else 0.0


def _gemm_fb(
    cl: Cluster, m: float, k: float, n: float, batch: float = 1, weight: bool = True
) -> tuple[float, float]:
    """(forward, backward) of C = A·B (B a ``weight``, or an activation): backward is
    dA = dC·Bᵀ (reads B again) and dB = Aᵀ·dC."""
    return (
        _gemm(cl, m, k, n, batch, weight),
        _gemm(cl, m, n, k, batch, weight) + _gemm(cl, k, m, n, batch),
    )


def _mem(cl: Cluster, nbytes: float, kernels: int) -> float:
    """Seconds of memory-bound kernels moving ``nbytes`` (counted for 2-byte activations, scaled
    to the cluster's ``act_bytes``) through HBM."""
    return (
        nbytes * cl.act_bytes / 2 / (cl.hbm_tbps * 1e12 * cl.hbm_efficiency)
        + kernels * cl.kernel_launch_us * 1e-6
    )


def _allreduce(
    n: int, nbytes: float, link: tuple[str, float, float], exchange: bool = False
) -> float:
    """Ring all-reduce: 2(n−1)/n of the bytes over the link, 2(n−1) latency steps. A direct
    ``exchange`` (every rank reads every other's whole tensor, then sums): n−1 times the bytes,
    one latency step."""
    if n == 1:
        return 0.0
    if exchange:
        return (n - 1) * nbytes / link[1] + link[2]
    return 2 * (n - 1) / n * nbytes / link[1] + 2 * (n - 1) * link[2]


def _gather(n: int, nbytes: float, link: tuple[str, float, float], exchange: bool = False) -> float:
    """Ring all-gather or reduce-scatter of ``nbytes`` (the whole tensor): half an all-reduce.
    A direct ``exchange`` moves the same bytes in one latency step."""
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / link[1] + (1 if exchange else n - 1) * link[2]


class UnitCost(NamedTuple):
    """Seconds and bytes of one (layer or embedding or head) × one micro-batch chunk."""

    f: float  # forward compute
    f_tp: float  # forward tensor-parallel collectives (on the critical path)
    b: float  # backward compute, recompute included
    b_tp: float
    act: float  # activation bytes held from the forward until the backward
    transient: float  # extra bytes live during the backward (full recompute: one layer's)
    recompute: float  # the part of ``b`` that is recomputation
    w: float = 0.0  # the part of ``b`` that is weight gradients (a zero-bubble schedule's W)
    # what that W costs on top when deferred: its GEMMs read their inputs and output gradients
    # back from memory (``mm_weight_gbps``; 0 on GPUs, where they come from HBM either way)
    w_cold: float = 0.0


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
    h, f, d = shape.hidden, shape.ffn_width, shape.head_dim
    T, t, heads = b * L, tp, shape.heads // tp
    kv = shape.kv_dim_on(tp)  # K (and V) width on this GPU: all of it when replicated
    qkv = h / t + 2 * kv
    r = 1 / t if sp else 1.0  # share of the replicated activations this GPU holds
    gemms = [
        _gemm_fb(cl, T, h, qkv),
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
        attn_mm = [
            _gemm_fb(cl, L, d, a + L, b * heads, weight=False),
            _gemm_fb(cl, L, a + L, d, b * heads, weight=False),
        ]
        attn_f = sum(x[0] for x in attn_mm) + _mem(cl, 9 * scores, 2)
        attn_b = sum(x[1] for x in attn_mm) + _mem(cl, 18 * scores, 2)
    # LayerNorms, bias + dropout + residual (7 bytes/element), bias + GeLU on the MLP width
    elem = T * (22 * h * r + 4 * f / t)
    fwd = sum(x[0] for x in gemms) + attn_f + _mem(cl, elem, 6)
    bwd = sum(x[1] for x in gemms) + attn_b + _mem(cl, 2 * elem, 8)
    comm = b_tp = 0.0
    if t > 1:
        link = cl.link(t)
        x = cl.tp_exchange
        one = _gather(t, cl.act_bytes * T * h, link, x)  # one all-gather or reduce-scatter
        # per layer each way: two all-reduces without SP, two all-gathers and two
        # reduce-scatters with it
        comm = 4 * one if sp else 2 * _allreduce(t, cl.act_bytes * T * h, link, x)
        b_tp = comm
        if kv * t > shape.kv_dim:  # replicated K/V heads: their weights' gradients summed
            b_tp += _allreduce(t, cl.act_bytes * 2 * (h + 1) * kv, link, x)
        if cl.tp_overlap:
            # the column-parallel layers' (QKV, fc1) input-gradient collective overlaps their
            # weight-gradient GEMM; under SP their input's all-gather also overlaps the
            # input-gradient GEMM; the row-parallel layers' all-gathers (SP) stay exposed
            dw = [_gemm(cl, h, T, qkv), _gemm(cl, h, T, f / t)]
            if sp:
                dx = [
                    _gemm(cl, T, qkv, h, weight=True),
                    _gemm(cl, T, f / t, h, weight=True),
                ]
                hidden = zip(dx, dw, strict=True)
                b_tp = 2 * one + sum(max(0.0, one - x) + max(0.0, one - w) for x, w in hidden)
            else:
                ar = comm / 2
                b_tp = sum(max(0.0, ar - w) for w in dw)
    f_tp = comm
    # activations (Korthikanti et al. 2022, §4), bytes per token per layer, generalized to the
    # kv width and the ffn: 14h + 4·kvd + 4·ffn (= 34h for a standard GPT), of which LayerNorm
    # inputs, the QKV and fc1 inputs and two dropout masks (10h) stay whole without SP; K and V
    # (4·kvd) are whole on every GPU when their heads are replicated
    split = (4 * h + 4 * f) / t + 4 * kv
    per_token = (10 * h + 4 * h + 4 * f) / t + 4 * kv if sp else 10 * h + split
    act_all = T * per_token + 5 * scores  # softmax output, its dropout mask and output: 5 B each
    prefix_copy = 4 * b * a * kv  # autopart's chunk saves [prefix; chunk] K and V again
    rec = 0.0
    transient = 0.0
    if recompute == "none":
        act = act_all + prefix_copy
    elif recompute == "selective":  # recompute the attention core in the backward
        act = act_all - 5 * scores + prefix_copy
        rec = attn_f if attention == "unfused" else 0.0  # flash recomputes inside its backward
    else:  # full: keep the layer input (and a chunk's K/V for the later chunks), redo forward
        act = T * 2 * h * r + (4 * T * kv + prefix_copy if a or shape.seq > L else 0)
        rec = fwd
        b_tp += comm
        transient = act_all + prefix_copy
    # weight gradients: dB = Aᵀ·dC of each layer GEMM (the other half of ``_gemm_fb``'s
    # backward), whose weights are k × n: QKV, the attention output, fc1, fc2; deferred, a W
    # reads back each GEMM's input (T × k) and output gradient (T × n)
    weights = ((h, qkv), (h / t, h), (h, f / t), (f / t, h))
    w = sum(_gemm(cl, k, T, n) for k, n in weights)
    cold = _cold_read(cl, T * sum(k + n for k, n in weights))
    return UnitCost(fwd, f_tp, bwd + rec, b_tp, act, transient, rec, w, cold)


@lru_cache(maxsize=65536)
def _embed_head(
    shape: GPTShape, cl: Cluster, tp: int, sp: bool, b: int, L: int
) -> tuple[UnitCost, UnitCost]:
    """(embedding, final norm + LM head + cross entropy) on ``b × L`` tokens."""
    h, t, T = shape.hidden, tp, b * L
    V = _padded_vocab(shape.vocab, tp)
    r = 1 / t if sp else 1.0
    link, x = cl.link(t), cl.tp_exchange
    act = cl.act_bytes * T * h
    # embedding: vocab-parallel lookup + position add + dropout; its output is all-reduced
    # (reduce-scattered under SP) over tp; the backward scatters the gradient into the table
    emb_tp_f = _gather(t, act, link, x) if sp else _allreduce(t, act, link, x)
    emb_tp_b = _gather(t, act, link, x) if sp else 0.0
    # its backward is the table's gradient: all weight gradient
    embed_b = _mem(cl, 6 * T * h, 2)
    embed = UnitCost(
        _mem(cl, 6 * T * h, 2), emb_tp_f, embed_b, emb_tp_b, T * h * r, 0.0, 0.0, embed_b
    )
    # head: final LayerNorm, logits (T × V/t), vocab-parallel cross entropy in fp32 (one
    # all-gather of each rank's 3 × T statistics); SP all-gathers the head's input, without SP
    # its gradient is all-reduced in the backward
    mm_f, mm_b = _gemm_fb(cl, T, h, V / t)
    ce = 10 * T * V / t
    tp_f = (_gather(t, act, link, x) if sp else 0.0) + _gather(t, 12 * T * t, link, x)
    tp_b = _gather(t, act, link, x) if sp else _allreduce(t, act, link, x)
    head = UnitCost(
        mm_f + _mem(cl, ce + 4 * T * h * r, 4),
        tp_f,
        mm_b + _mem(cl, ce + 8 * T * h * r, 4),
        tp_b,
        T * (4 * h * r + 6 * V / t),
        0.0,
        0.0,
        _gemm(cl, h, T, V / t),
        _cold_read(cl, T * (h + V / t)),
    )
    return embed, head


def _padded_vocab(vocab: int, tp: int) -> int:
    step = VOCAB_MULTIPLE * tp
    return -(-vocab // step) * step


@lru_cache(maxsize=4096)
def _chunks(c1: float, c2: float, seq: int, k: int, split: str, multiple: int) -> tuple[int, ...]:
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
    weights and column-parallel biases split over tp (K/V's whole when tp is a multiple of
    their heads), LayerNorms and row-parallel biases whole; the vocab-parallel embedding on stage 0, the final norm (and, when the head is
    on another rank or untied, its copy of the table) on the last stage."""
    p, t, h = st.pp, st.tp, shape.hidden
    n_stages = p * st.virtual_stages
    vocab = _padded_vocab(shape.vocab, t)
    col_bias = (h + 2 * shape.kv_dim) + shape.ffn_width
    split = shape.layer_matmul_params + col_bias
    if shape.kv % t:  # replicated K/V heads: their weights and biases whole on every GPU
        split -= 2 * (h + 1) * shape.kv_dim
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
        speed: SpeedModel = DEDICATED,
    ) -> None:
        plan.check_model(shape.layers, shape.heads, shape.kv, shape.ffn_width, shape.seq)
        self.shape, self.cluster, self.st = shape, cluster, plan
        self.speed = speed  # how ranks computing at once on a node slow each other
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
        r = 1 / t if st.sequence_parallel or cl.p2p_scatter_gather else 1.0
        self.send_bytes = [cl.act_bytes * b * L * h * r for L in self.chunk_lengths]
        # scatter-gather without SP: the receiver all-gathers the tp slices over NVLink
        self.p2p_gather = [
            _gather(t, cl.act_bytes * b * L * h, cl.link(t))
            if cl.p2p_scatter_gather and not st.sequence_parallel
            else 0.0
            for L in self.chunk_lengths
        ]
        self._stride = st.dp * t  # global rank distance between pipeline neighbours
        self._stage_params, self.params = stage_params(shape, st)
        self.tied_ranks = shape.tied and p > 1
        self.split_backward = traits(st.schedule).split_backward

    def placement(self) -> list[tuple[int, float]]:
        """Per pipeline rank: (the node its dp × tp processes sit on, how many of them sit
        there), pipeline-outermost (``autopart/layout.py``): what the speed model shares."""
        g = self.cluster.gpus_per_node
        return [(r * self._stride // g, float(min(self._stride, g))) for r in range(self.st.pp)]

    # -- per-action costs (simulate_actions callbacks) ----------------------------------------

    def action_cost(self, a: Action) -> float:
        """Seconds of an F/B (tp collectives included), a stage's DP reduction, or TIE_REDUCE."""
        fixed = self.cluster.action_overhead_us * 1e-6
        if a.kind == "F":
            u = self.units[a.stage][a.chunk]
            return u.f + u.f_tp + fixed
        if a.kind == "B":  # split (zero bubble): the input gradients only
            u = self.units[a.stage][a.chunk]
            return u.b + u.b_tp - (u.w if self.split_backward else 0.0) + fixed
        if a.kind == "W":
            u = self.units[a.stage][a.chunk]
            return u.w + u.w_cold
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
        return self.send_bytes[a.chunk] / link[1] + link[2] + self.p2p_gather[a.chunk]

    def p2p_link(self, i: int, j: int) -> tuple[str, float, float]:
        """The link between pipeline positions i and j, for the worst of the dp × tp
        pipelines: InfiniBand if any of their pairs sits on two nodes."""
        lo, hi = min(i, j), max(i, j)
        g = self.cluster.gpus_per_node
        first, last = lo * self._stride, (hi + 1) * self._stride - 1
        span = g + 1 if first // g != last // g else 1
        return self.cluster.link(span)

    def dp_reduce_time(self, stage: int) -> float:
        """Gradient reduction of one stage over dp: ``grad_bytes`` per parameter (4: Megatron's
        fp32 main grads), all-reduced, or reduced-scattered with the distributed optimizer."""
        dp = self.st.dp
        if dp == 1:
            return 0.0
        nbytes = self.cluster.grad_bytes * self._stage_params[stage]
        link = self.cluster.link(dp * self.st.tp, self.st.tp)
        if self.st.distributed_optimizer and self.cluster.grad_reduce_scatter:
            return _gather(dp, nbytes, link)
        return _allreduce(dp, nbytes, link)

    def tie_time(self) -> float:
        """All-reduce of the tied embedding's gradient between the first and last rank."""
        nbytes = self.cluster.grad_bytes * self.vocab * self.shape.hidden / self.st.tp
        return _allreduce(2, nbytes, self.p2p_link(0, self.st.pp - 1))

    def optimizer_time(self, rank: int) -> float:
        """Adam step, memory-bound: read fp32 grad, master, m, v; write master, m, v and the
        bf16 parameter; the gradient norm reads the gradient again (34 bytes per parameter);
        with the distributed optimizer each dp rank updates 1/dp of them."""
        cl = self.cluster
        n = self.params[rank] / (self.st.dp if self.st.distributed_optimizer else 1)
        # every rank steps at once: each slowed as the speed model says for a full node
        return self.speed.crowding(min(self.st.gpus, cl.gpus_per_node)) * _mem(
            cl, 34 * n * 2 / cl.act_bytes, 4
        )

    def param_gather_time(self, rank: int) -> float:
        """Distributed optimizer: all-gather of the updated parameters (``act_bytes`` each,
        the compute dtype) over dp."""
        if not self.st.distributed_optimizer or self.st.dp == 1:
            return 0.0
        return _gather(
            self.st.dp,
            self.cluster.act_bytes * self.params[rank],
            self.cluster.link(self.st.dp * self.st.tp, self.st.tp),
        )

    # -- memory -------------------------------------------------------------------------------

    def static_bytes(self, rank: int) -> dict[str, float]:
        """Parameters (bf16), gradients (fp32) and Adam states (fp32 master, m, v) of a rank;
        Megatron's 18 bytes per parameter, or 6 + 12/dp with the distributed optimizer."""
        n = self.params[rank]
        opt = 12 * n / (self.st.dp if self.st.distributed_optimizer else 1)
        return {"parameters": 2 * n, "gradients": 4 * n, "optimizer": opt}

    def activation_peak(self, actions: list[Action], transient: bool = True) -> float:
        """Most activation bytes a rank holds: a unit's from its F until its B ends (its W in a
        zero-bubble schedule); during a B
        the unit's transient bytes (full recompute: one layer's activations) are live too
        (``transient=False``: only the held bytes, what ``Runner.peak_saved_bytes`` counts)."""
        held = peak = 0.0
        act: float
        extra: float
        for a in actions:
            if a.kind in ("F", "B", "W"):
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
                if not self.split_backward:
                    held -= act
            elif a.kind == "W":  # a split backward frees the unit at its W (an upper bound:
                held -= act  # the inputs of the weight GEMMs are only part of it)
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
