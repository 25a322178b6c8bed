"""Attention whose scores are modified by functions of positions (``passes/position_masks.py``,
``canonicalize_attention``'s ``_position_mask``, ``_scored`` and ``_score_function``): each
chunkable construct chunks exactly under Seq1F1B (loss and every gradient, float64, several
cuts), and each construct that is not a causal function of positions is refused before any
rank runs, naming the node and why (negative controls: the same model with the construct
swapped for a chunkable one passes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_sequence_chunk import _chunked_exactly, _reference, run_chunks
from torch import nn

from autopart import Mesh, parallelize
from autopart.errors import AutopartError
from autopart.frontend.capture import capture
from autopart.meta import META_ATTENTION, META_KV, META_MASK_FN, META_SCORES, META_WINDOW

SDPA = torch.ops.aten.scaled_dot_product_attention.default
LOW = torch.finfo(torch.float32).min  # a float64 one overflows where() of Python floats


class _Scores(nn.Module):
    """Embedding, one attention layer of 2 heads (width 8) whose scores get ``kind``'s
    modification, and a head. Chunkable kinds: "causal" (the control), "alibi" (a per-head
    slope × key position, BLOOM), "alibi-end" (slope × (j − s + 1), MPT), "capped" (tanh
    soft-capping, Gemma 2), "sink" (a learned sink column per head, its row max subtracted,
    gpt-oss), "sink-scale" (the same sink applied after the softmax: the output times
    sigmoid(logsumexp(scores) − sink), Granite SWA), "chunked" (an SDPA mask: causal within blocks of 4, Llama 4), "folded" (heads
    folded into the batch, a clamp at the float minimum, XGLM), "folded-qk" (only q and k
    folded, the scores unfolded before the mask and v never folded: GPT-NeoX-Japanese), "gpt1" (scores × mask − 1e4
    where masked: a weight exp(−1e4 − max) is exactly 0), "where-min" (``where(keep, scores,
    tensor(finfo.min))``, GPT-Neo), "key-bias" (an SDPA mask of one bias
    per key computed from its token, filled where the causal mask hides the key: Doge),
    "alibi-mask" (ALiBi as SDPA's float mask, slope · (j − i), filled where the causal mask
    hides the key: it was read as "0 kept, anything else dropped", a window of one key, and
    chunked silently wrong until the twenty-third session).
    Refused kinds: "soft" (−1 where
    masked), "where-soft" (GPT-Neo's form with tensor(−1.0)), "shallow" (scores × mask − 100: a weight e^−100 ≈ 4e−44 is not 0), "capped-end"
    (MPT's bias under the
    soft-cap: not a function of positions), "length" (a bias j / s), "length-peek" and
    "length-band" (a peek at the next key, or a window of 6 keys instead of 2, only at lengths
    that are 4 mod 12, computed from ``ones(s).sum()``), "strict" (a query does
    not see itself: the first one then hides every key alike, and sees them all), "blocks" (an SDPA mask of whole blocks: later keys), "sink-tokens" (a sink
    column from a running sum over the sequence), "sink-scale-tokens" (a post-softmax sink
    computed from each query's token), "key-bias-open" (the per-key bias with no
    causal fill: later keys seen), "pair-bias" (a bias per query and key from their tokens),
    "alibi-mask-open" (the SDPA float mask's bias with no causal fill: later keys seen; it ran
    as a window of one key).
    Windows of 4 keys: "capped-window" (soft-capped, Gemma 2's local layers) and "sink-window"
    (gpt-oss's local layers) hand on 3 positions of K/V; "capped-chunked" (soft-capped, causal
    within blocks of 4) hides every key 4 behind too, but depends on where the blocks start:
    it keeps its whole prefix. Refused: "capped-peek" (soft-capped, and from query 24 on every
    key is seen: causal at 21 tokens, not at the longest length proven)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.qkv, self.out = nn.Embedding(50, 16), nn.Linear(16, 48), nn.Linear(16, 50)
        if kind.startswith("sink"):
            self.sinks = nn.Parameter(torch.tensor([0.5, -1.0]))
        if kind.endswith("-bias") or kind == "key-bias-open":
            self.gate = nn.Linear(16, 2)
        self.register_buffer("slopes", torch.tensor([0.5, 0.25]).view(1, 2, 1, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        keep = j <= i
        if self.kind.endswith("-window"):
            keep = keep & (i - j < 4)
        elif self.kind == "capped-chunked":
            keep = keep & (i // 4 == j // 4)
        elif self.kind == "capped-peek":
            keep = keep | (i >= 24)
        elif self.kind.startswith("length-"):  # the length read as a value: 16 (% 12 == 4) at
            n = torch.ones(s).sum()  # the example, none of the lengths a proof evaluates at
            if self.kind == "length-peek":  # each query also sees the next key
                keep = keep | (((n % 12) == 4) & (j == i + 1))
            else:  # a window of 2 keys, or 6 at such lengths
                keep = keep & (i - j < torch.where((n % 12) == 4, 6, 2))
        mask = torch.where(keep, 0.0, LOW)
        if self.kind in ("key-bias", "key-bias-open", "pair-bias"):
            bias = self.gate(self.emb(ids)).transpose(1, 2)[:, :, None, :]  # [b, 2, 1, s]
            if self.kind == "pair-bias":  # query i's row scaled by its own token's gate
                bias = bias * bias.transpose(-1, -2)
            hide = torch.zeros_like(keep) if self.kind == "key-bias-open" else ~keep
            mask = bias.expand(b, 2, s, s).masked_fill(hide, LOW)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.out(y.transpose(1, 2).reshape(b, s, 16))
        if self.kind in ("alibi-mask", "alibi-mask-open"):  # a bias in SDPA's float mask
            bias = (self.slopes * (j - i)).expand(b, 2, s, s)
            mask = bias if self.kind == "alibi-mask-open" else bias.masked_fill(~keep, LOW)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.out(y.transpose(1, 2).reshape(b, s, 16))
        if self.kind in ("chunked", "blocks"):
            allowed = (i // 4 == j // 4) & (keep if self.kind == "chunked" else True)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
            return self.out(y.transpose(1, 2).reshape(b, s, 16))
        if self.kind == "folded-qk":
            scores = torch.baddbmm(
                torch.zeros(b * 2, s, s, dtype=q.dtype),
                q.reshape(b * 2, s, 8),
                k.reshape(b * 2, s, 8).transpose(1, 2),
                alpha=8**-0.5,
            )
            probs = torch.softmax(scores.view(b, 2, s, s) + mask, dim=-1)
            return self.out(torch.matmul(probs, v).transpose(1, 2).reshape(b, s, 16))
        if self.kind == "folded":
            scores = torch.bmm(q.reshape(b * 2, s, 8), k.reshape(b * 2, s, 8).transpose(1, 2))
            scores = scores.view(b, 2, s, s) * 8**-0.5 + mask
            scores = torch.max(scores, torch.tensor(LOW)).view(b * 2, s, s)
            y = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(b * 2, s, 8))
            return self.out(y.view(b, 2, s, 8).transpose(1, 2).reshape(b, s, 16))
        scores = torch.matmul(q, k.transpose(-1, -2)) * 8**-0.5
        if self.kind == "alibi":
            scores = scores + self.slopes * j
        elif self.kind == "alibi-end":
            scores = scores + self.slopes * (j - s + 1)
        elif self.kind in ("capped", "capped-window", "capped-chunked", "capped-peek"):
            scores = torch.tanh(scores / 3.0) * 3.0
        elif self.kind == "capped-end":
            scores = torch.tanh((scores + self.slopes * (j - s + 1)) / 3.0) * 3.0
        elif self.kind == "length":
            scores = scores + j / s
        if self.kind in ("where-min", "where-soft"):
            scores = torch.where(
                keep, scores, torch.tensor(LOW if self.kind == "where-min" else -1.0)
            )
        elif self.kind == "soft":
            scores = scores + torch.where(keep, 0.0, -1.0)
        elif self.kind in ("gpt1", "shallow"):
            scores = scores * keep + (-1e4 if self.kind == "gpt1" else -100.0) * (~keep)
        elif self.kind == "strict":
            scores = scores + torch.where(j < i, 0.0, LOW)
        else:
            scores = scores + mask
        if self.kind in ("sink-scale", "sink-scale-tokens"):
            sinks = self.sinks.view(1, 2, 1)
            if self.kind == "sink-scale-tokens":
                sinks = sinks + q.sum(-1)
            scale = torch.sigmoid(torch.logsumexp(scores, dim=-1) - sinks).unsqueeze(-1)
            y = torch.matmul(torch.softmax(scores, dim=-1), v) * scale
            return self.out(y.transpose(1, 2).reshape(b, s, 16))
        if self.kind in ("sink", "sink-tokens", "sink-window"):
            sinks = self.sinks.view(1, 2, 1, 1).expand(b, 2, s, 1)
            if self.kind == "sink-tokens":  # a running sum over the sequence: mixes tokens
                sinks = sinks + q.sum(-1, keepdim=True).cumsum(2)
            scores = torch.cat([scores, sinks], dim=-1)
            scores = scores - scores.max(dim=-1, keepdim=True)[0]
            probs = torch.softmax(scores, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return self.out(torch.matmul(probs, v).transpose(1, 2).reshape(b, s, 16))


CUTS = ((6, 10), (1, 7, 8), (4, 4, 4, 4))


@pytest.mark.parametrize(
    ("kind", "form"),
    [
        pytest.param("causal", "sdpa", marks=pytest.mark.slow),  # suite time: the zoo's BLOOM,
        pytest.param("alibi", "sdpa", marks=pytest.mark.slow),  # MPT and every causal model
        ("alibi-end", "sdpa"),
        ("folded", "sdpa"),
        ("folded-qk", "sdpa"),
        ("chunked", "sdpa"),
        ("capped", "scores"),
        ("sink", "scores"),
        ("sink-scale", "scores"),
        ("gpt1", "scores"),
        ("where-min", "sdpa"),
        ("key-bias", "sdpa"),
        ("alibi-mask", "sdpa"),
    ],
)
def test_position_functions_chunk_exactly(kind: str, form: str) -> None:
    """Each chunkable kind becomes a canonical attention — SDPA with its mask rebuilt from the
    sizes of q and k (``autopart.mask_fn``), or, for a soft-cap or a sink, the model's own nodes
    marked as one attention (``autopart.scores``) — and its chunks (three cuts, one of a single
    token) give the whole sequence's loss and every gradient."""
    ids = torch.randint(1, 50, (2, 16))
    _, gm = _chunked_exactly(_Scores(kind), ids, CUTS)
    attention = [
        n
        for n in gm.graph.nodes
        if str(n.meta.get(META_ATTENTION, "")).startswith("causal")
        and (n.target == SDPA or n.meta.get(META_SCORES) == "pv")
    ]
    assert len(attention) == 1
    (n,) = attention
    if form == "sdpa":
        assert n.target == SDPA
        if kind == "key-bias":  # the bias is k's last column (and q's a column of 1/scale)
            assert n.args[0].meta["val"].shape[-1] == n.args[1].meta["val"].shape[-1] == 9
        elif kind != "causal":  # its mask: rebuilt, with the key length of [prefix; chunk]
            assert n.args[3].meta.get(META_MASK_FN)
            assert any(m.meta.get(META_MASK_FN) == "keys" for m in gm.graph.nodes)
    else:
        assert n.meta[META_SCORES] == "pv" and n.target == torch.ops.aten.matmul.default


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("capped-window", marks=pytest.mark.slow),  # suite time: sink-window has
        "sink-window",  # the same trim, the matrix's Gemma 2 and gpt-oss rows the real ones
        pytest.param("capped-chunked", marks=pytest.mark.slow),
    ],
)
def test_a_window_of_a_score_function_trims_the_prefix(kind: str) -> None:
    """A soft-capped or sink attention within a window of 4 keys is marked with its window
    (``position_masks.score_window``), hands on the last 3 positions of [prefix; chunk] K/V
    with a prefix length of its own, and chunks exactly, also with chunks shorter than the
    window; handing on 2 positions does not match. Negative control: blocks of 4 also hide
    every key 4 behind, but a query's keys depend on where its block starts, so shifting the
    positions changes the function: no window, the whole prefix, still exact."""
    torch.manual_seed(0)  # the negative control's difference must not hang on the worker's RNG
    ids = torch.randint(1, 50, (2, 16))
    captured, gm = _chunked_exactly(_Scores(kind), ids, (*CUTS, (8, 1, 2, 5)))
    (pv,) = [n for n in gm.graph.nodes if n.meta.get(META_SCORES) == "pv"]
    handed = next(n for n in gm.graph.nodes if n.op == "output").args[0][-gm.meta[META_KV] :]
    if kind == "capped-chunked":
        assert pv.meta.get(META_WINDOW) is None
        assert all(n.target == torch.ops.aten.cat.default for n in handed)
        return
    assert pv.meta[META_WINDOW] == 4
    assert all(n.target == torch.ops.aten.slice.Tensor and n.args[1:3] == (-2, -3) for n in handed)
    ref_loss, _ = _reference(captured, (ids, ids))
    for n in handed:  # one position fewer than the window needs
        n.args = (n.args[0], -2, -2, *n.args[3:])
    gm.recompile()
    wrong, _ = run_chunks(captured, gm, (ids, ids), [6, 10])
    assert not torch.allclose(wrong, ref_loss, rtol=1e-6)


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("soft", "lets a query see later keys"),
        ("where-soft", "where_1 (where.self) is not elementwise in the scores"),
        ("shallow", "a later key's score is -100: above -10000"),
        ("capped-end", "not a function of positions"),
        ("capped-peek", "lets a query see later keys at sequence 4096"),
        ("length", "uses the sequence length as a value (div"),
        # the twenty-second session's probe: causal and consistent at every length tried, not
        # at the example's, where each chunk built it at its own length (gradients 63 % off)
        ("length-peek", "reads the sequence length through sum"),
        ("length-band", "reads the sequence length through sum"),
        # the first query hides every key alike, so its softmax weighs them all equally
        ("strict", "lets a query see later keys at sequence 3"),
        ("blocks", "lets a query see later keys"),
        ("sink-tokens", "a sink column computed from the tokens"),
        ("sink-scale-tokens", "Seq1F1B cannot chunk node"),
        ("key-bias-open", "lets a query see later keys"),
        ("pair-bias", "its mask depends on"),
        ("alibi-mask-open", "lets a query see later keys"),
    ],
)
def test_what_is_not_a_causal_function_of_positions_is_refused(kind: str, why: str) -> None:
    """Negative controls: refused at compile time, naming the attention and the reason (the
    chunkable kinds above are the same model with the construct swapped)."""
    ids = torch.randint(1, 50, (2, 16))
    with pytest.raises(AutopartError) as err:
        parallelize(capture(_Scores(kind).double(), (ids, ids)), Mesh(), schedule="seq1f1b")
    assert why in err.value.message
    assert (
        "not a causal function of positions" in err.value.message
        or "tokens" in kind
        or kind == "where-soft"
    )
    assert "1f1b" in err.value.hint


@pytest.mark.slow  # suite time: compiles the zoo's MPT (17 s)
def test_a_per_head_mask_is_split_with_the_heads_under_tp() -> None:
    """MPT's ALiBi (slope · (j − s + 1), one slope per head) under tp = 2 and Seq1F1B: the
    attention is split by heads (it was left replicated: "attention mask differs per head"),
    each rank reading its own heads' rows of the rebuilt mask (``index_select`` by
    ``tp_rank``). Its loss and every gradient match one device on real ranks in the zoo's MPT
    row (tp=2×pp=2 Seq1F1B k=2, under -m slow with the whole matrix)."""
    from autopart.meta import META_INPUT
    from autopart.models import zoo

    model, batch = zoo.make("mpt")
    program = parallelize(
        capture(model.double(), batch), Mesh(tp=2), schedule="seq1f1b", seq_chunks=2
    )
    (stage,) = program.rank(1).stages
    nodes = list(stage.graph.graph.nodes)
    picks = [n for n in nodes if n.target == torch.ops.aten.index_select.default]
    sdpas = [n for n in nodes if n.target == SDPA]
    assert len(sdpas) == 2 and all(n.args[0].meta["val"].shape[1] == 2 for n in sdpas)  # 2 of 4
    assert len(picks) == 2 and all(
        p.args[2].args[1].args[0].meta[META_INPUT].kind == "rank" for p in picks
    )


class _LearnedSlopes(nn.Module):
    """One attention layer (q, k, v, o projections, 2 heads) whose SDPA mask is ALiBi with
    learned slopes: a per-head mask read from a parameter, which no pass rebuilds."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 16), nn.Linear(16, 50)
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.slopes = nn.Parameter(torch.tensor([0.5, 0.25]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.emb(ids)
        q, k, v = (f(x).view(b, s, 2, 8).transpose(1, 2) for f in (self.q, self.k, self.v))
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        bias = self.slopes.view(1, 2, 1, 1) * (j - i).clamp(max=0)
        mask = bias.masked_fill(j > i, LOW)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(self.o(y.transpose(1, 2).reshape(b, s, 16)))


def test_a_per_head_mask_from_parameters_stays_replicated_under_tp(caplog) -> None:
    """Negative control: the same per-head mask read from a parameter (learned slopes) is not
    the same on every rank by construction, so tp leaves the attention replicated, saying so."""
    import logging

    ids = torch.randint(1, 50, (2, 16))
    with caplog.at_level(logging.WARNING, logger="autopart"):
        program = parallelize(capture(_LearnedSlopes().double(), (ids, ids)), Mesh(tp=2))
    assert any("attention mask differs per head" in r.getMessage() for r in caplog.records)
    (stage,) = program.rank(0).stages
    nodes = list(stage.graph.graph.nodes)
    assert not any(n.target == torch.ops.aten.index_select.default for n in nodes)
    (sdpa,) = [n for n in nodes if n.target == SDPA]
    assert sdpa.args[0].meta["val"].shape[1] == 2  # both heads on every rank


class _Linear(nn.Module):
    """Linear attention (no softmax) of 2 heads, as MiniMax's lightning attention computes one
    block of 32 tokens: (q·kᵀ ∘ D[:s, :s]) · v plus (q ∘ d[:s]) · S, the decay tables buffers
    sliced by the length (D: exp(−slope·(i − j)) at and below the diagonal, 0 above; d: one
    decay per position), S a learned state; a learned position table sliced by the length is
    added to the embeddings. Chunkable kinds: "decay"; "lightning" (the same through MiniMax's
    block loop: export bounds s to one block, and the blocks are cut at min(s, 32)). Refused:
    "open" (D = exp(−slope·|i − j|): later keys weigh), "ends" (keys decayed by their distance
    from the end, like MiniMax's key_decay: not a function of positions), "shifted" (the
    position table read from row 1: not token t's row)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.qkv, self.out = nn.Embedding(50, 16), nn.Linear(16, 48), nn.Linear(16, 50)
        self.pos = nn.Parameter(0.1 * torch.randn(33, 16))
        self.state = nn.Parameter(0.1 * torch.randn(2, 8, 8))
        slope = torch.tensor([0.5, 0.25]).view(2, 1, 1)
        d = slope * (torch.arange(32)[:, None] - torch.arange(32)[None, :])
        diag = (
            torch.exp(-d.abs())
            if kind == "open"
            else torch.exp(torch.where(d >= 0, -d, -torch.inf))
        )
        self.register_buffer("diag", diag[None])  # [1, 2, 32, 32]
        self.register_buffer("qdecay", torch.exp(-slope * (torch.arange(32)[:, None] + 1)))
        self.register_buffer("kdecay", torch.exp(-slope * (32 - torch.arange(32)[:, None] - 1)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        pos = self.pos[1 : s + 1] if self.kind == "shifted" else self.pos[:s]
        q, k, v = self.qkv(self.emb(ids) + pos).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.kind == "lightning":
            blocks = []
            for i in range((s + 31) // 32):
                lo, hi = i * 32, min(i * 32 + 32, s)
                blocks.append(self._block(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], hi - lo))
            y = torch.cat(blocks, dim=-2)
        else:
            y = self._block(q, k, v, s)
        return self.out(y.transpose(1, 2).reshape(b, s, 16))

    def _block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
        w = torch.matmul(q, k.transpose(-1, -2)) * self.diag[:, :, :n, :n]
        if self.kind == "ends":
            w = w * self.kdecay[:, -n:].transpose(-1, -2)
        return torch.matmul(w, v) + torch.matmul(q * self.qdecay[:, :n], self.state)


@pytest.mark.parametrize(
    "kind", [pytest.param("decay", marks=pytest.mark.slow), "lightning"]
)  # suite time: lightning is decay through the block loop
def test_a_linear_attention_with_position_decays_chunks_exactly(kind: str) -> None:
    """Form 8 of ``canonicalize_attention``: the product of decayed scores with v is one
    attention (``autopart.scores`` "pv", causal), given a K/V prefix; the per-position decay
    and the learned position table are read at the chunk's rows (``index_select`` from the
    offset); MiniMax's block loop folds to whole slices (``fold_identities``). Three cuts, one
    of a single token: the whole sequence's loss and every gradient."""
    ids = torch.randint(1, 50, (2, 16))
    _, gm = _chunked_exactly(_Linear(kind), ids, CUTS)
    nodes = list(gm.graph.nodes)
    (pv,) = [n for n in nodes if n.meta.get(META_SCORES) == "pv"]
    assert pv.meta[META_ATTENTION] == "causal, chunked"
    assert sum(n.target == torch.ops.aten.index_select.default for n in nodes) == 2
    assert not any(n.target is torch.sym_min for n in nodes)


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("open", "lets a query see later keys"),
        ("ends", "not a function of positions"),
        ("shifted", "slice"),
    ],
)
def test_a_linear_attention_that_is_not_a_position_function_is_refused(kind: str, why: str) -> None:
    """Negative controls of form 8 and of a table's rows: refused at compile time, naming the
    node (the chunkable kinds above are the same model with the construct swapped)."""
    ids = torch.randint(1, 50, (2, 16))
    with pytest.raises(AutopartError) as err:
        parallelize(capture(_Linear(kind).double(), (ids, ids)), Mesh(), schedule="seq1f1b")
    assert why in err.value.message
    assert "1f1b" in err.value.hint
