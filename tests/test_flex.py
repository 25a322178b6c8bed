"""``runtime/flex.py``: attention lowered to FlexAttention computes what the graph computed.

Each case is an attention written the way models write it, captured with ``torch.export``
(ATen ops, as autopart's capture keeps them), lowered, and run against the graph as captured on
the same float64 q, k, v: the output and the gradients of q, k and v (and of a sink) must agree
to round-off. torch 2.13 refuses FlexAttention's backward on the CPU in its public entry point
(``_validate_device``); the ``dense_cpu_backward`` fixture lifts that guard, and torch then runs
its own dense reference forward and backward (no kernel of ours, nothing mocked). The Triton
kernels are CUDA's: ``tests/test_gpu.py``.

Negative controls: a step that is not elementwise (``exp``), a term computed from a parameter,
dropout, and heads folded into the batch are left as they are, with why.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.attention.flex_attention as fa
from torch import nn

from autopart.errors import AutopartError
from autopart.frontend.capture import InputRef
from autopart.graph import copy_graph
from autopart.layout import Plan
from autopart.meta import META_INPUT
from autopart.parity.verify import Check, parse_plans
from autopart.runtime import flex

B, H, S, D = 2, 3, 24, 8


@pytest.fixture
def dense_cpu_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's dense FlexAttention backward on the CPU (see the module docstring)."""
    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    monkeypatch.setattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)


def _causal(lq: int, lk: int, window: int | None = None) -> torch.Tensor:
    rows = torch.arange(lk - lq, lk)[:, None]
    cols = torch.arange(lk)[None, :]
    keep = cols <= rows
    return keep & (cols > rows - window) if window else keep


class Masked(nn.Module):
    """SDPA with a boolean mask built from positions: causal within a sliding window."""

    def forward(self, q, k, v):
        mask = _causal(q.shape[-2], k.shape[-2], window=5)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)


class Alibi(nn.Module):
    """SDPA with an additive mask: a per-head slope times the distance, −inf above."""

    def forward(self, q, k, v):
        lq, lk = q.shape[-2], k.shape[-2]
        slopes = 2.0 ** -torch.arange(1, q.shape[1] + 1, dtype=q.dtype)
        dist = torch.arange(lk, dtype=q.dtype)[None, :] - torch.arange(lk - lq, lk)[:, None]
        bias = slopes[:, None, None] * dist
        bias = bias.masked_fill(~_causal(lq, lk), float("-inf"))
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)


class SoftCapped(nn.Module):
    """Gemma 2's eager attention: scaled scores, tanh soft-capping, an additive window mask,
    softmax in float32 and back."""

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
        s = torch.tanh(s / 5.0) * 5.0
        mask = torch.zeros(q.shape[-2], k.shape[-2], dtype=q.dtype)
        s = s + mask.masked_fill(~_causal(q.shape[-2], k.shape[-2], 6), float("-inf"))
        p = nn.functional.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, v)


class Sinks(nn.Module):
    """gpt-oss: a learned sink column per head joins the scores, the row max is subtracted, the
    sink's probability is cut off after the softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(H, dtype=torch.float64))

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) * D**-0.5
        s = s.masked_fill(~_causal(q.shape[-2], k.shape[-2]), float("-inf"))
        sink = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        joined = torch.cat([s, sink], dim=-1)
        joined = joined - joined.max(dim=-1, keepdim=True).values
        p = nn.functional.softmax(joined, dim=-1)[..., :-1]
        return torch.matmul(p, v)


class Exp(nn.Module):
    """A step that is not elementwise-replayable by allow-list: exp of the scores."""

    def forward(self, q, k, v):
        s = torch.exp(torch.matmul(q, k.transpose(2, 3)) * 0.1)
        s = s.masked_fill(~_causal(q.shape[-2], k.shape[-2]), float("-inf"))
        return torch.matmul(nn.functional.softmax(s, dim=-1), v)


class LearnedBias(nn.Module):
    """A term computed from a parameter: FlexAttention would give it no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(S, S, dtype=torch.float64))

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) + self.bias
        return torch.matmul(nn.functional.softmax(s, dim=-1), v)


class Dropped(nn.Module):
    """Dropout on the probabilities: FlexAttention has none."""

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(2, 3))
        p = nn.functional.dropout(nn.functional.softmax(s, dim=-1), p=0.5, training=True)
        return torch.matmul(p, v)


class Folded(nn.Module):
    """Heads folded into the batch (BLOOM's baddbmm form): 3-D scores."""

    def forward(self, q, k, v):
        q3, k3, v3 = (x.reshape(B * H, -1, D) for x in (q, k, v))
        s = torch.bmm(q3, k3.transpose(1, 2))
        s = s.masked_fill(~_causal(q.shape[-2], k.shape[-2]), float("-inf"))
        return torch.bmm(nn.functional.softmax(s, dim=-1), v3).reshape(B, H, -1, D)


def _captured(module: nn.Module, lq: int, lk: int) -> torch.fx.GraphModule:
    """The module's export graph, its inputs marked as a stage graph's (parameters by FQN)."""
    q, k, v = _qkv(lq, lk)
    ep = torch.export.export(module, (q, k, v), strict=False)
    gm = ep.graph_module
    params = [s.target for s in ep.graph_signature.input_specs if s.kind.name == "PARAMETER"]
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            kind = "param" if params and n.name.startswith("p_") else "act"
            n.meta[META_INPUT] = InputRef(kind, n.name)
    return gm


def _qkv(lq: int, lk: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(lq * 100 + lk)
    shapes = [(B, H, lq, D), (B, H, lk, D), (B, H, lk, D)]
    return [torch.randn(s, dtype=torch.float64, generator=gen) * 2 for s in shapes]


def _run(gm: torch.fx.GraphModule, module: nn.Module, lq: int, lk: int):
    q, k, v = (x.requires_grad_() for x in _qkv(lq, lk))
    params = list(module.parameters())
    out = gm(*params, q, k, v)
    out = out[0] if isinstance(out, (tuple, list)) else out
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), [*params, q, k, v])
    return out.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


# (module, q length, k length, tolerance): k longer than q is a Seq1F1B chunk after its K/V
# prefix. The soft-capped graph rounds its softmax to float32 (as Gemma 2's eager code does);
# FlexAttention keeps float64, so the two differ by float32 round-off there
LOWERED = {
    "window-mask": (Masked, S, S, 1e-12),
    "window-mask-prefix": (Masked, 8, S, 1e-12),
    "alibi": (Alibi, S, S, 1e-12),
    "alibi-prefix": (Alibi, 8, S, 1e-12),
    "soft-capped": (SoftCapped, S, S, 1e-6),
    "soft-capped-prefix": (SoftCapped, 8, S, 1e-6),
    "sinks": (Sinks, S, S, 1e-12),
    "sinks-prefix": (Sinks, 8, S, 1e-12),
}


@pytest.mark.parametrize("case", list(LOWERED))
def test_lowered_attention_matches_the_graph(case: str, dense_cpu_backward: None) -> None:
    make, lq, lk, tolerance = LOWERED[case]
    torch.manual_seed(0)
    module = make()
    gm = _captured(module, lq, lk)
    lowered = copy_graph(gm)
    report = flex.lower_attention(lowered)
    assert len(report.lowered) == 1 and not report.kept, report
    targets = {n.target for n in lowered.graph.nodes}
    assert targets & {flex.flex_sdpa, flex.flex_general}
    assert not targets & {torch.ops.aten.softmax.int, torch.ops.aten._softmax.default}
    want, want_grads = _run(gm, module, lq, lk)
    got, got_grads = _run(lowered, module, lq, lk)
    assert _rel(got, want) < tolerance
    for g, w in zip(got_grads, want_grads, strict=True):
        assert _rel(g, w) < tolerance


def test_a_window_skips_whole_blocks(dense_cpu_backward: None) -> None:
    """The block mask FlexAttention gets from a sliding window (soft-capped form, 512 queries,
    window 6, blocks of 128) visits the diagonal blocks and the one before each only."""
    q = torch.zeros(1, 1, 512, D, dtype=torch.float64)
    mask = torch.zeros(512, 512, dtype=torch.float64)
    mask = mask.masked_fill(~_causal(512, 512, 6), float("-inf"))
    steps = ((torch.ops.aten.add.Tensor, (flex.PREV, flex.term(0))),)
    keep = ~flex._hidden(steps, [flex._four(mask)])
    block = flex._block_mask(keep, q, q)
    assert block is not None
    visited = block.to_dense()[0, 0]
    assert visited.sum().item() == 4 + 3  # 4 diagonal blocks, 3 blocks behind them
    # a mask of the float minimum (finite) hides nothing for sure: every block is visited
    finite = torch.zeros(512, 512, dtype=torch.float64).masked_fill(
        ~_causal(512, 512), torch.finfo(torch.float64).min
    )
    keep = ~flex._hidden(steps, [flex._four(finite)])
    assert flex._block_mask(keep, q, q).to_dense()[0, 0].sum().item() == 16
    # no term: no block mask at all
    assert flex._block_mask(~flex._hidden((), []), q, q) is None


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (Exp, "is not an elementwise step of f"),
        (LearnedBias, "not a constant of the step"),
        (Dropped, "before a product with v"),
    ],
)
def test_what_it_cannot_replay_stays(make, why: str, dense_cpu_backward: None) -> None:
    torch.manual_seed(0)
    module = make()
    gm = _captured(module, S, S)
    before = [n.target for n in gm.graph.nodes]
    report = flex.lower_attention(gm)
    assert not report.lowered and len(report.kept) == 1 and why in report.kept[0], report
    assert [n.target for n in gm.graph.nodes] == before


def test_heads_narrower_than_the_kernels_take_stay() -> None:
    """Compiling for CUDA, the runner asks for head dims of 16 and more (Triton's ``tl.dot``):
    a head dim of 8 stays as captured, with why."""
    gm = _captured(Masked(), S, S)
    report = flex.lower_attention(gm, min_head_dim=16)
    assert not report.lowered and "a head dim below 16" in report.kept[0]
    assert len(flex.lower_attention(gm, min_head_dim=8).lowered) == 1


def test_folded_heads_stay_without_a_word() -> None:
    """3-D scores are not the form: left alone (SDPA-free eager BLOOM keeps its kernels)."""
    gm = _captured(Folded(), S, S)
    report = flex.lower_attention(gm)
    assert not report.lowered


def test_flex_is_a_plan_field() -> None:
    plan = Plan.of(pp=2, schedule="seq1f1b", seq_chunks=2, microbatches=2, attention="flex")
    assert "attention=flex" in plan.describe()
    assert Plan.from_json(plan.to_json()) == plan
    (check,) = parse_plans("pp=2,seq1f1b,k=2,m=2,attention=flex", "autopart.models.zoo:gemma2")
    assert check.plan.attention == "flex" and "attention=flex" in str(check)
    with pytest.raises(AutopartError, match="unknown attention 'fused'"):
        Plan.of(attention="fused")
    assert str(Check("x", attention="flex")) == "1f1b,attention=flex"


def test_cpu_training_is_refused_before_a_step() -> None:
    """torch 2.13 has no FlexAttention backward on the CPU: a rank refuses attention='flex'
    when it is built, naming itself, instead of failing at its first step."""
    with pytest.raises(AutopartError, match=r"rank 3: attention='flex' cannot run on cpu"):
        flex.check_supported(torch.device("cpu"), 3)


def test_sink_scaling_is_the_softmax_with_one_more_column() -> None:
    """The identity the sink lowering rests on: softmax([x, s])[:-1] = softmax(x) · σ(lse − s)."""
    x, s = torch.randn(7, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)
    want = torch.softmax(torch.cat([x, s[None]]), 0)[:-1]
    got = torch.softmax(x, 0) * torch.sigmoid(torch.logsumexp(x, 0) - s)
    assert torch.allclose(got, want, rtol=1e-14, atol=0)
    assert math.isclose(float(got.sum() + torch.sigmoid(s - torch.logsumexp(x, 0))), 1.0)


@pytest.mark.slow
def test_lowered_graphs_trace_through_torch_compile(dense_cpu_backward: None) -> None:
    """What ``compile=True`` does to a lowered stage graph before code generation: Dynamo and
    AOTAutograd trace it (block masks built inside, dynamic shapes) with its backward. Run here
    with the ``aot_eager`` backend (Inductor's CPU template for FlexAttention is not built in
    this torch); the Triton kernels are CUDA's. Inside the compiled path FlexAttention keeps its
    log-sum-exp in float32, so a sink's scale agrees to float32 round-off."""
    for make, tolerance in ((Alibi, 1e-12), (SoftCapped, 1e-6), (Sinks, 1e-6)):
        torch.manual_seed(0)
        module = make()
        gm = _captured(module, 8, S)
        lowered = copy_graph(gm)
        assert len(flex.lower_attention(lowered).lowered) == 1
        compiled = torch.compile(lowered, backend="aot_eager", dynamic=True)
        got, got_grads = _run(compiled, module, 8, S)
        want, want_grads = _run(gm, module, 8, S)
        assert _rel(got, want) < tolerance, make.__name__
        for g, w in zip(got_grads, want_grads, strict=True):
            assert _rel(g, w) < tolerance, make.__name__


FLEX_ZOO = {  # architecture: the plan it runs under attention="flex", its matrix dtype
    "gemma2": ("pp=2 Seq1F1B k=2", "float64"),  # soft-capping (general form), windows
    "gpt_oss": ("pp=2 Seq1F1B k=2", "float32"),  # sinks, windows (experts: no float64 kernel)
    "bloom": ("pp=2 Seq1F1B k=2", "float64"),  # ALiBi as an additive mask
    "llama4_text": ("pp=2 Seq1F1B k=2", "float64"),  # chunked attention's mask
    "mistral": ("tp=2×pp=2 Seq1F1B k=2", "float64"),  # a window, heads split by tp
}


@pytest.mark.slow
@pytest.mark.multirank
def test_zoo_models_under_flex_match_one_device(dense_cpu_backward: None) -> None:
    """Real Hugging Face models on real gloo ranks (forked: they inherit the lifted guard) with
    every rank lowering its attention: loss and every gradient equal the one-device run within
    the row's tolerance. Each program's stage graphs lower at least one attention each."""
    from autopart.api import parallelize
    from autopart.frontend.capture import capture
    from autopart.models import zoo
    from autopart.parity.verify import verify_many

    checks: dict[str, dict[str, Check]] = {"float64": {}, "float32": {}}
    for arch, (plan, dtype) in FLEX_ZOO.items():
        fields = {**zoo.PLANS[plan], "attention": "flex"}
        model, batch = zoo.make(arch)
        program = parallelize(capture(model, batch), None, plan=Plan.of(**fields))
        for rank in program.ranks:
            for stage in rank.stages:
                assert flex.lower_attention(copy_graph(stage.graph)).lowered, (arch, rank.rank)
        checks[dtype][arch] = Check(f"autopart.models.zoo:{arch}", **fields)
    for dtype, batch_of_checks in checks.items():
        reports = verify_many(batch_of_checks, dtype=dtype, timeout_s=180, via="fork")
        bad = {a: str(r) for a, r in reports.items() if isinstance(r, Exception) or not r.ok}
        assert not bad, bad


def test_the_summary_names_what_was_left() -> None:
    reports = {
        0: flex.Lowered(["sdpa", "sdpa_1"], []),
        1: flex.Lowered(["pv"], ["softmax (h.3.attn): exp_1 (aten.exp.default) is not ...", "x"]),
    }
    line = flex.summary(reports)
    assert line.startswith("attention=flex: lowered to FlexAttention (stage 0: 2, stage 1: 1)")
    assert line.endswith(
        "left as captured: softmax (h.3.attn): exp_1 (aten.exp.default) is not ... (+1 more)"
    )
    one = flex.summary({0: flex.Lowered(["a"], [])})
    assert one == "attention=flex: lowered to FlexAttention (stage 0: 1)"


@pytest.mark.slow
@pytest.mark.multirank
def test_batch_masks_under_flex_match_one_device(dense_cpu_backward: None) -> None:
    """The batch's own masks through FlexAttention: left padding (``attention_mask``) and
    packed documents (``position_ids``) on HF Llama, under tp=2 and pp=2 Seq1F1B k=2 (whose
    chunks' masks are document-causal after their K/V prefix), every rank lowering them."""
    from parity_cases import ROOT

    from autopart.parity.verify import verify_many

    seq = {"pp": 2, "schedule": "seq1f1b", "seq_chunks": 2, "microbatches": 2}
    checks = {
        f"{m} {name}": Check(f"{ROOT}/examples/hf_llama.py:{m}", **plan, attention="flex")
        for m in ("make_padded", "make_packed")
        for name, plan in (("tp=2", {"tp": 2}), ("seq1f1b", seq))
    }
    reports = verify_many(checks, via="fork", timeout_s=120)
    bad = {n: str(r) for n, r in reports.items() if isinstance(r, Exception) or not r.ok}
    assert not bad, bad


class OneKeyHead(nn.Module):
    """Multi-query attention as Falcon writes it: k and v of one head, broadcast by SDPA."""

    def forward(self, q, k, v):
        mask = _causal(q.shape[-2], k.shape[-2], window=5)
        return nn.functional.scaled_dot_product_attention(q, k[:, :1], v[:, :1], attn_mask=mask)


def test_one_key_head_broadcast_is_grouped_query(dense_cpu_backward: None) -> None:
    module = OneKeyHead()
    gm = _captured(module, 8, S)
    lowered = copy_graph(gm)
    assert len(flex.lower_attention(lowered).lowered) == 1
    (call,) = [n for n in lowered.graph.nodes if n.target == flex.flex_sdpa]
    assert call.kwargs["enable_gqa"] is True
    want, want_grads = _run(gm, module, 8, S)
    got, got_grads = _run(lowered, module, 8, S)
    assert _rel(got, want) < 1e-12
    for g, w in zip(got_grads, want_grads, strict=True):
        assert _rel(g, w) < 1e-12


class LearnedMask(nn.Module):
    """An SDPA whose additive mask is a parameter (a learned bias): it needs a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(S, S, dtype=torch.float64))

    def forward(self, q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


class Widened(nn.Module):
    """Scores of one sequence widened to B by a per-row term: f's output has more rows than
    q·kᵀ, which FlexAttention (one score per q row) cannot give."""

    def forward(self, q, k, v):
        s = torch.matmul(q[:1], k[:1].transpose(2, 3))
        s = s + torch.arange(B, dtype=q.dtype).view(B, 1, 1, 1)
        return torch.matmul(torch.softmax(s, dim=-1), v[:1])


@pytest.mark.parametrize(
    ("make", "why"),
    [(LearnedMask, "computed from parameters"), (Widened, "does not broadcast to the scores")],
)
def test_what_flex_cannot_take_stays(make, why: str) -> None:
    module = make()
    gm = _captured(module, S, S)
    report = flex.lower_attention(gm)
    assert not report.lowered and why in report.kept[0], report


def test_inspect_says_what_each_rank_lowers(capsys: pytest.CaptureFixture[str]) -> None:
    """``autopart inspect --attention flex`` prints, per rank shown, what it will lower."""
    from autopart.cli import main

    assert main(["inspect", "--model", "autopart.models.zoo:mistral", "--attention", "flex"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: attention=flex: lowered to FlexAttention (stage 0: 2)" in out
