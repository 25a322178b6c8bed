"""Strided shards of a fused QKV (issue 37's tp, the twenty-sixth session's probe): a column
matmul's output cut into equal parts (nanoGPT's ``split``) or viewed as ``(3, heads, hd)``
(timm's) is sharded strided, each rank its heads of q, of k and of v. That layout is only right
for the readers of the cut parts: a second projection added before the cut, a row matmul
reading the whole output, or a second cut of another count saw the strided features as
contiguous ones and trained silently wrong (loss 2e-4 to 6e-3 off at tp=2, gradients 110 %
off; the ``split`` forms were wrong before the view form existed), and so did a second cut
of the cut parts, or a cut of features repeated in place (a review of that fix). Those
regions stay replicated now, and match one device; the proven forms split, and match too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity_cases import assert_all_pass, batch, cross_section, selects_slow
from torch import nn

from autopart import Mesh, parallelize
from autopart.frontend.capture import capture
from autopart.meta import META_INPUT
from autopart.parity.verify import Check

pytestmark = pytest.mark.multirank
W, H, V = 32, 4, 64


class Attention(nn.Module):
    """``kind``: "view" (timm's), "split" (nanoGPT's), "gain" (scaled by a parameter first),
    "sum" / "sum-split" (a second projection added before the cut), "whole" / "whole-split"
    (the output also read whole by a row matmul), "chunk" (also cut in 2 for a gated matmul),
    "twice" (the projection applied again and sliced), "twice-whole" (applied again and read
    whole by a row matmul), "bias" (its bias read whole too), "nested" (q | k | v cut again
    into 2 along the heads), "repeated" (each feature repeated 3 times in place, then cut in
    3)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv, self.qkv2, self.proj = nn.Linear(W, 3 * W), nn.Linear(W, 3 * W), nn.Linear(W, W)
        self.whole, self.gated = nn.Linear(3 * W, W), nn.Linear(3 * W // 2, W)
        self.gain = nn.Parameter(torch.tensor([1.3]))
        self.proj_half = nn.Linear(W // 2, W)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        t = self.qkv(h)
        if self.kind == "gain":
            t = self.gain * t
        if self.kind.startswith("sum"):
            t = t + self.qkv2(h)
        if self.kind == "repeated":
            a, g, c = t[..., :W].repeat_interleave(3, dim=-1).chunk(3, -1)
            return self.proj(a * torch.sigmoid(g) + c)
        if self.kind == "nested":
            x1, x2 = t.view(b, s, 3, H, W // H).chunk(2, dim=3)
            q, k, v = (x1 * x2).permute(2, 0, 3, 1, 4).unbind(0)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj_half(y.transpose(1, 2).reshape(b, s, W // 2))
        if self.kind.endswith("split"):
            q, k, v = (x.view(b, s, H, W // H).transpose(1, 2) for x in t.split(W, dim=-1))
        else:
            q, k, v = t.view(b, s, 3, H, W // H).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.proj(y.transpose(1, 2).reshape(b, s, W))
        if self.kind.startswith("whole"):
            out = out + self.whole(F.gelu(t))
        if self.kind == "chunk":
            u1, u2 = t.chunk(2, -1)
            out = out + self.gated(u1 * u2) * 0.1
        if self.kind == "twice":
            out = out + self.proj(torch.tanh(self.qkv(h)[..., :W]))
        if self.kind == "twice-whole":
            out = out + self.whole(F.gelu(self.qkv(torch.tanh(h))))
        if self.kind == "bias":
            out = out + 0.1 * self.qkv.bias[:W]
        return out


class Model(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.wte, self.attn = nn.Embedding(V, W), Attention(kind)
        self.ln, self.head = nn.LayerNorm(W), nn.Linear(W, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        return self.head(h + self.attn(self.ln(h)))


def make(kind: str):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (4, 32))
    return Model(kind), (ids, torch.roll(ids, -1, 1))


KINDS = [
    "view",
    "split",
    "gain",
    "sum",
    "sum-split",
    "whole",
    "whole-split",
    "chunk",
    "twice",
    "twice-whole",
    "bias",
    "nested",
    "repeated",
]
SPLIT = {"view", "split", "gain"}  # proven: the fused weight is sharded strided in 3
DEFAULT = ["sum-split", "whole", "chunk", "nested"]


def _factory(kind: str):
    return lambda: make(kind)


@pytest.fixture(scope="module")
def reports(request: pytest.FixtureRequest) -> dict:
    kinds = KINDS if selects_slow(request.config) else DEFAULT
    return batch({k: Check(_factory(k), tp=2) for k in kinds})


@pytest.mark.parametrize("kind", cross_section(KINDS, DEFAULT))
def test_a_fused_qkv_matches_one_device_at_tp2(kind: str, reports: dict) -> None:
    assert_all_pass({kind: reports[kind]})


@pytest.mark.parametrize("kind", KINDS)
def test_a_strided_shard_only_where_the_cut_alone_reads_the_projection(kind: str) -> None:
    model, data = make(kind)
    program = parallelize(capture(model.double(), data), Mesh(tp=2))
    (stage,) = program.ranks[0].stages
    shard = next(
        n.meta["autopart.shard"]
        for n in stage.graph.graph.nodes
        if n.op == "placeholder" and n.meta[META_INPUT].name == "attn.qkv.weight"
    )
    if kind in SPLIT:
        assert shard is not None and (shard.dim, shard.strided) == (0, 3), shard
    else:
        assert shard is None, shard
