"""Causal convolutions along the sequence under Seq1F1B (issue 37, carried state): float64
parity on real ranks of a toy model written here — gated short convolutions (LFM2's form and a
left-padded, dilated one whose window is longer than a chunk) between causal attention blocks —
against one device; and the convolutions Seq1F1B cannot chunk, refused at compile time naming
the node. LFM2 itself is in tests/test_zoo.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity_cases import assert_all_pass, assert_passes, batch
from torch import nn

from autopart import AutopartError, Mesh, parallelize
from autopart.frontend.capture import capture
from autopart.models import zoo
from autopart.parity.verify import Check, Report

pytestmark = pytest.mark.multirank
WIDTH, VOCAB = 32, 64


class ShortConv(nn.Module):
    """LFM2's mixer: in_proj to (B, C, x), B·x convolved depthwise along the sequence, times C,
    out_proj. ``form``: "sliced" (``nn.Conv1d(padding=(k − 1)·d)`` cut back to the first s
    outputs, LFM2's), "left-pad" (``F.pad(x, ((k − 1)·d, 0))`` then no padding), and two that
    are not causal convolutions of one output per token: "same" (padded (k − 1)·d / 2 on both
    sides, not cut: the output at t reads later inputs) and "stride" (stride 2)."""

    def __init__(self, kernel: int, dilation: int, form: str) -> None:
        super().__init__()
        self.form, self.window = form, (kernel - 1) * dilation
        padding = self.window // 2 if form == "same" else self.window if form != "left-pad" else 0
        self.in_proj = nn.Linear(WIDTH, 3 * WIDTH)
        self.conv = nn.Conv1d(
            WIDTH,
            WIDTH,
            kernel,
            groups=WIDTH,
            padding=padding,
            dilation=dilation,
            stride=2 if form == "stride" else 1,
        )
        self.out_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s = h.shape[1]
        b, c, x = self.in_proj(h).transpose(-1, -2).chunk(3, dim=-2)
        x = b * x
        if self.form == "left-pad":
            y = self.conv(F.pad(x, (self.window, 0)))
        elif self.form == "stride":
            y = self.conv(x)[..., : s // 2].repeat_interleave(2, dim=-1)
        elif self.form == "same":
            y = self.conv(x)
        else:
            y = self.conv(x)[..., :s]
        return self.out_proj((c * y).transpose(-1, -2))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, 4, WIDTH // 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, WIDTH))


class Block(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.mixer = mixer
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.mixer(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Toy(nn.Module):
    """Embedding + learned positions, then conv (kernel 3), attention, conv (``form``; kernel 6,
    dilation 2: a window of 10 inputs, longer than an 8-token chunk), attention; norm, head."""

    def __init__(self, form: str = "left-pad") -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(64, WIDTH)
        self.blocks = nn.ModuleList(
            [
                Block(ShortConv(3, 1, "sliced")),
                Block(Attention()),
                Block(ShortConv(6, 2, form)),
                Block(Attention()),
            ]
        )
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_toy(form: str = "left-pad"):
    torch.manual_seed(0)
    return Toy(form), zoo.batch(VOCAB, 4, 32)


SEQ = {"pp": 2, "schedule": "seq1f1b", "microbatches": 2}
CASES = {
    "toy pp=2 Seq1F1B k=2": {**SEQ, "seq_chunks": 2},
    "toy pp=2 Seq1F1B k=4": {**SEQ, "seq_chunks": 4},  # 8-token chunks, a 10-input window
}
SLOW_CASES = {
    "toy tp=2×pp=2 Seq1F1B k=2": {**SEQ, "tp": 2, "seq_chunks": 2},
    "toy tp=2×pp=2 Seq1F1B k=2 SP": {**SEQ, "tp": 2, "seq_chunks": 2, "sequence_parallel": True},
    "toy pp=2 v=2 Seq1F1B-interleaved k=2": {
        **SEQ,
        "schedule": "seq1f1b-interleaved",
        "virtual_stages": 2,
        "seq_chunks": 2,
    },
    "toy pp=2 Seq1F1B k=4 uniform, full recompute": {
        **SEQ,
        "seq_chunks": 4,
        "seq_split": "uniform",
        "recompute": "full",
    },
}


@pytest.fixture(scope="module")
def reports() -> dict[str, Report | AutopartError]:
    return batch({name: Check(make_toy, **kw) for name, kw in CASES.items()})


@pytest.mark.parametrize("case", list(CASES))
def test_causal_convolutions_chunk_exactly(case: str, reports: dict) -> None:
    """Loss and every gradient (the conv weights' included) as on one device, to 1e-9."""
    assert_passes(reports[case])


@pytest.mark.slow
def test_causal_convolutions_chunk_exactly_on_more_plans() -> None:
    assert_all_pass(batch({name: Check(make_toy, **kw) for name, kw in SLOW_CASES.items()}))


@pytest.mark.parametrize(
    ("form", "why"),
    [
        ("same", "padded by 5 for a window of 10 inputs (kernel 6, dilation 2)"),
        ("stride", "with stride 2"),
    ],
)
def test_convolutions_that_are_not_causal_are_refused(form: str, why: str) -> None:
    """Negative controls: the same toy with its second conv padded on both sides and not cut
    back (it reads later tokens), or of stride 2, is refused by parallelize, naming the conv."""
    model, data = make_toy(form)
    captured = capture(model.double(), data)
    with pytest.raises(AutopartError) as err:
        parallelize(captured, Mesh(pp=2), schedule="seq1f1b", seq_chunks=2, microbatches=2)
    want = f"node conv1d_1 (blocks.2.mixer.conv): a convolution along the sequence {why}"
    assert want in err.value.message, err.value.message
    assert "1f1b" in err.value.hint


@pytest.mark.parametrize("form", ["sliced", "same"])
def test_a_convolution_sequence_parallelism_runs_whole_is_still_proven_causal(form: str) -> None:
    """Under SP the convolutions (no tp rule) run on the whole sequence joined from the tp
    ranks' halves, whose length reads 2·(s//2): the cut back to the first s outputs is still
    recognized (it was refused as not causal until the twenty-fourth session; parity in
    SLOW_CASES), and a conv that reads later tokens is still refused."""
    from autopart.layout import Plan
    from autopart.lowering.compile import compile_program

    model, data = make_toy(form)
    captured = capture(model.double(), data)
    plan = Plan(
        Mesh(pp=2, tp=2),
        schedule="seq1f1b",
        seq_chunks=2,
        microbatches=2,
        sequence_parallel=True,
    )
    if form == "sliced":
        assert len(compile_program(captured, plan).ranks) == 4
        return
    with pytest.raises(AutopartError, match="node conv1d_1 .* padded by 5 for a window of 10"):
        compile_program(captured, plan)
