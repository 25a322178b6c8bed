"""canonicalize_attention: causal attention in every captured form becomes one SDPA node."""

from __future__ import annotations

from dataclasses import replace

import hf_gpt2
import hf_llama
import nanogpt
import pytest
import torch
import torch.nn.functional as F
from conftest import feed
from torch import nn

from autopart.api import parallelize
from autopart.errors import AutopartError
from autopart.frontend.capture import capture
from autopart.graph import copy_graph
from autopart.layout import Mesh, Plan
from autopart.lowering.compile import seq_limits
from autopart.meta import META_ATTENTION, META_PROVEN_SEQ, META_WINDOW
from autopart.parity.verify import verify
from autopart.passes.canonicalize_attention import SDPA, canonicalize_attention, require_causal

SEQ1F1B = Plan(Mesh(), schedule="seq1f1b")


def _run(captured):
    """The pass as compile runs it: on a copy, with the graph's longest sequence (nanoGPT's
    mask buffer is that long: its masks are proven up to there)."""
    gm = copy_graph(captured.graph)
    gm.meta.update(captured.graph.meta)
    return canonicalize_attention(gm, replace(SEQ1F1B, max_seq=seq_limits(captured)[1]))


@pytest.mark.parametrize(
    "make",
    [nanogpt.make, nanogpt.make_manual, hf_gpt2.make, hf_llama.make],
    ids=["sdpa-causal", "manual-masked-softmax", "hf-gpt2-mask", "hf-llama-mask"],
)
def test_every_form_becomes_one_causal_sdpa(make) -> None:
    model, batch = make()
    captured = capture(model.double(), batch)
    gm = _run(captured)
    sdpa = [n for n in gm.graph.nodes if n.target == SDPA]
    assert len(sdpa) == 2  # one per block
    for n in sdpa:
        assert n.meta[META_ATTENTION] == "causal" and n.args[5] is True and n.args[3] is None
    assert not [
        n
        for n in gm.graph.nodes
        if n.target in (torch.ops.aten.softmax.int, torch.ops.aten.masked_fill.Scalar)
    ]
    require_causal(gm)
    (before,) = captured.graph(*feed(captured, batch))
    (after,) = gm(*feed(captured, batch))
    assert torch.allclose(after, before, rtol=1e-12, atol=0)


class _Masked(nn.Module):
    """One attention layer with a mask built in the graph: causal, windowed, padding, or full."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.emb, self.qkv, self.out = (
            kind,
            nn.Embedding(50, 16),
            nn.Linear(16, 48),
            nn.Linear(16, 50),
        )
        self.register_buffer("win", torch.tensor(20))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        pos = torch.arange(s)
        if self.kind == "causal":
            mask = pos[None, :] <= pos[:, None]
        elif self.kind == "window":  # sliding window of 20 keys: causal until 21 tokens
            mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 20)
        elif self.kind == "float-window":  # the same window, no integer naming its length
            mask = (pos[None, :] <= pos[:, None]) & ((pos[:, None] - pos[None, :]) * 0.05 < 1)
        elif self.kind == "buffer-window":  # the same window, its length a buffer's value
            mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < self.win)
        elif self.kind == "float-peek":  # causal until query 19.5, then the next key too
            mask = (pos[None, :] <= pos[:, None]) | (
                (pos[:, None].double() > 19.5) & (pos[None, :] == pos[:, None] + 1)
            )
        elif self.kind == "padding":
            mask = (pos[None, :] <= pos[:, None]) & (ids != 0)[:, None, None, :]
        else:
            mask = torch.ones(s, s, dtype=torch.bool)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, 16))


@pytest.mark.parametrize(
    ("kind", "causal"),
    [
        ("causal", True),
        ("window", True),
        ("float-window", True),
        ("buffer-window", True),
        ("float-peek", False),
        ("padding", False),
        ("full", False),
    ],
)
def test_masks_are_proven_by_evaluation(kind: str, causal: bool) -> None:
    """Each mask is evaluated up to the longest sequence the program will take (4096 tokens
    here), so a window or a later key that shows only past the short lengths tried first, and
    past any integer the construction names (a float threshold, a scale, a buffer's value), is
    seen: a 20-key window stays a window, a peek at the next key from query 20 on is not
    causal (both were taken for plain causal masks on every plan, with gradients 20 % off)."""
    ids = torch.randint(1, 50, (2, 24))  # longer than the window: the window shows
    captured = capture(_Masked(kind), (ids, ids))
    gm = _run(captured)
    marks = [n.meta.get(META_ATTENTION) for n in gm.graph.nodes if META_ATTENTION in n.meta]
    assert marks and all((m == "causal") == causal for m in marks), marks
    windows = [n.meta[META_WINDOW] for n in gm.graph.nodes if n.target == SDPA and causal]
    assert windows == ([20] if "window" in kind else [None] if causal else [])
    assert gm.meta.get(META_PROVEN_SEQ) == (4096 if causal else None)
    if causal:  # the canonical form computes what the model did
        (before,) = captured.graph(*feed(captured, (ids, ids)))
        (after,) = gm(*feed(captured, (ids, ids)))
        assert torch.allclose(after, before, rtol=1e-5)
    if causal:
        require_causal(gm)
    else:
        with pytest.raises(AutopartError) as err:
            require_causal(gm)
        assert "not causal" in err.value.message and "1f1b" in err.value.hint


def test_other_schedules_leave_the_graph_alone() -> None:
    model, batch = nanogpt.make_manual()
    captured = capture(model, batch)
    gm = copy_graph(captured.graph)
    before = gm.code
    assert canonicalize_attention(gm, Plan(Mesh())).code == before


class _Additive(nn.Module):
    """Manual attention with an additive mask, as GPT-J and eager Hugging Face models build it:
    q and k cast to float32 (in a float64 model), ``q·kᵀ / c + mask``, softmax, back to the
    model's dtype, ``· v``. ``kind``: "causal" (0 / float32 min), "unscaled" (no ÷ c), "soft"
    (−1 where masked: a bias, not a mask), "capped" (tanh soft-capped scores), "alibi" (a
    per-key-position bias on top of the causal mask)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.qkv, self.out = nn.Embedding(50, 16), nn.Linear(16, 48), nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        pos = torch.arange(s)
        keep = pos[None, :] <= pos[:, None]
        lowest = -1.0 if self.kind == "soft" else torch.finfo(torch.float32).min
        mask = torch.where(keep, 0.0, lowest)
        if self.kind == "near":  # later keys 1 below the kept ones: weight e⁻¹, not 0
            mask = torch.where(keep, -9999.0, -10000.0)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2))
        if self.kind != "unscaled":
            scores = scores / 8**0.5
        if self.kind == "capped":
            scores = torch.tanh(scores / 30.0) * 30.0
        if self.kind == "alibi":
            mask = mask + 0.5 * pos.float()[None, :]
        probs = torch.softmax(scores + mask, dim=-1).to(v.dtype)
        y = torch.matmul(probs, v)
        return self.out(y.transpose(1, 2).reshape(b, s, 16))


@pytest.mark.parametrize(
    ("kind", "causal"),
    [
        ("causal", True),
        ("unscaled", True),
        ("soft", False),
        ("near", False),
        ("capped", True),
        ("alibi", True),
    ],
)
def test_additive_masks_with_casts(kind: str, causal: bool) -> None:
    """A proven additive causal mask becomes SDPA in the scores' dtype (float32 here), with its
    scale (1 when unscaled) and casts, computing the same loss to float32 round-off; so does an
    ALiBi bias on it (its mask then a rebuilt function of positions). Soft-capped scores stay
    the model's nodes, marked one attention (``autopart.scores``). A bias that is not −inf where
    masked stays as it is (Seq1F1B then refuses it), and so does one whose masked entries are
    −1e4 but kept ones −9999: hidden is relative to the row's largest entry (it was proven
    causal, and Seq1F1B trained it 26 % off: mixer probe, seventeenth session)."""
    ids = torch.randint(1, 50, (2, 12))
    captured = capture(_Additive(kind).double(), (ids, ids))
    gm = _run(captured)
    sdpa = [n for n in gm.graph.nodes if n.target == SDPA]
    assert len(sdpa) == int(causal and kind != "capped"), gm.code
    (before,) = captured.graph(*feed(captured, (ids, ids)))
    (after,) = gm(*feed(captured, (ids, ids)))
    assert torch.allclose(after, before, rtol=1e-6, atol=0)
    if kind == "capped":
        assert [n.meta.get("autopart.scores") for n in gm.graph.nodes].count("pv") == 1
        require_causal(gm)
    elif causal:
        (n,) = sdpa
        assert n.meta["val"].dtype == torch.float32 and n.kwargs["scale"] == (
            1.0 if kind == "unscaled" else pytest.approx(8**-0.5)
        )
        require_causal(gm)
    else:
        with pytest.raises(AutopartError) as err:
            parallelize(captured, Mesh(), schedule="seq1f1b", seq_chunks=2)
        assert "softmax" in err.value.message or "not causal" in err.value.message


def test_a_mask_buffer_of_a_meta_model_is_refused_by_name() -> None:
    """A model built on the meta device has buffers without values: the manual attention's
    causal mask cannot be evaluated, so Seq1F1B refuses it saying so. The pass crashed with
    "Tensor.item() cannot be called on meta tensors" and called it a bug in autopart; 1F1B,
    which evaluates no mask, still compiles."""
    with torch.device("meta"):
        model = nanogpt.GPT(nanogpt.GPTConfig(attention="manual"))
    ids = torch.randint(0, 96, (4, 32))
    batch = (ids, ids.roll(-1, 1))
    with pytest.raises(AutopartError, match="a buffer of a model on the meta device"):
        parallelize(model, Mesh(pp=2), batch, schedule="seq1f1b", seq_chunks=2, microbatches=2)
    parallelize(model, Mesh(pp=2), batch, microbatches=2)


def test_compiling_draws_nothing_from_torchs_generator() -> None:
    """The live API compiles on rank 0 only, so a draw from torch's generator there (the mask
    proofs' made-up token ids did) put rank 0's next ``torch.rand`` out of step with the other
    ranks': a sampler or gradient noise seeded alike then differed per rank."""
    model, batch = nanogpt.make_manual()  # a masked softmax: proven by evaluation
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    parallelize(model.double(), Mesh(), batch, schedule="seq1f1b")
    assert torch.equal(torch.rand(3), want)


class _Written(_Masked):
    """``_Masked``'s layer, causal, its softmax written out by hand in one of several ways."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        x = (q @ k.transpose(-2, -1) / 8**0.5).masked_fill(
            torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")
        )
        if self.kind == "amax":
            e = torch.exp(x - x.amax(-1, keepdim=True))
        elif self.kind == "max-detached":
            e = torch.exp(x - x.max(dim=-1, keepdim=True)[0].detach())
        elif self.kind == "no-max":
            e = x.exp()
        else:  # "over-queries": the sum runs over the queries (a column softmax)
            e = x.exp().nan_to_num(0.0)
            return self.out((e / e.sum(-2, keepdim=True) @ v).transpose(1, 2).reshape(b, s, 16))
        return self.out((e / e.sum(-1, keepdim=True) @ v).transpose(1, 2).reshape(b, s, 16))


@pytest.mark.parametrize(
    ("kind", "causal"),
    [("amax", True), ("max-detached", True), ("no-max", True), ("over-queries", False)],
)
def test_a_softmax_written_by_hand_is_a_softmax(kind: str, causal: bool) -> None:
    """``e / e.sum(-1, keepdim=True)`` with ``e = exp(x − rowmax)`` (or ``exp(x)``) is a
    softmax over the keys, so the attention is recognized (it was refused as "a value pairing
    tokens with tokens"); a quotient by a sum over the queries is not, and stays."""
    ids = torch.randint(1, 50, (2, 24))
    captured = capture(_Written(kind).double(), (ids, ids))
    gm = _run(captured)
    marks = [n.meta.get(META_ATTENTION) for n in gm.graph.nodes if META_ATTENTION in n.meta]
    assert marks == (["causal"] if causal else [])
    (before,) = captured.graph(*feed(captured, (ids, ids)))
    (after,) = gm(*feed(captured, (ids, ids)))
    assert torch.allclose(after, before, rtol=1e-12, atol=0)
    if not causal:
        with pytest.raises(AutopartError, match="cannot chunk"):
            parallelize(captured, None, plan=Plan(Mesh(), schedule="seq1f1b", seq_chunks=2))


def _written_model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (4, 24), generator=torch.Generator().manual_seed(1))
    return _Written("amax"), (ids, torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1))


@pytest.mark.multirank
def test_a_softmax_written_by_hand_chunks_at_one_devices_gradients() -> None:
    report = verify(_written_model, schedule="seq1f1b", seq_chunks=3, via="fork", timeout_s=120)
    assert report.ok, str(report)


class _Tempered(nn.Module):
    """Scores times a learned temperature: one number, or one per key position."""

    def __init__(self, per_key: bool) -> None:
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(50, 16), nn.Linear(16, 48), nn.Linear(16, 50)
        self.temp = nn.Parameter(torch.full((24,) if per_key else (), 0.3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        x = (
            (q @ k.transpose(-2, -1)) * self.temp[:s]
            if self.temp.dim()
            else (q @ k.transpose(-2, -1)) * self.temp
        )
        x = x.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        return self.out((x.softmax(-1) @ v).transpose(1, 2).reshape(b, s, 16))


@pytest.mark.parametrize("per_key", [False, True])
def test_a_learned_temperature_moves_onto_the_queries(per_key: bool) -> None:
    """``(q @ kᵀ) * self.temp``, one learned number, was refused under Seq1F1B ("reads the
    param temp", the eighteenth session's model probe); it is ``(q * temp) @ kᵀ``, and the
    attention is recognized with the same values. One temperature per key position is not
    one number and stays unrecognized."""
    ids = torch.randint(1, 50, (2, 24))
    captured = capture(_Tempered(per_key).double(), (ids, ids))
    gm = _run(captured)
    marks = [n.meta.get(META_ATTENTION) for n in gm.graph.nodes if META_ATTENTION in n.meta]
    assert (marks == ["causal"]) != per_key, marks
    (before,) = captured.graph(*feed(captured, (ids, ids)))
    (after,) = gm(*feed(captured, (ids, ids)))
    assert torch.allclose(after, before, rtol=1e-12, atol=0)
