"""``einsum_products``: an einsum that pairs tokens with tokens as a batched matrix product
(attention's q·kᵀ and p·v) becomes permutes and a matmul with the same values; one over blocks
of the sequence (Mamba-2's) or with a summed letter of one operand stays. The rewritten
attention is then recognized: Seq1F1B chunks it and tp splits its heads, both at one device's
loss and gradients on real ranks (before: refused, and left replicated)."""

from __future__ import annotations

import dataclasses
import math

import torch
from conftest import rel_err, run_graph
from parity_cases import assert_all_pass
from torch import nn
from tp_models import params

from autopart import Mesh
from autopart.frontend.capture import capture
from autopart.graph import copy_graph
from autopart.layout import Plan
from autopart.lowering.pass_runner import run_passes
from autopart.meta import META_ATTENTION, META_SHARD
from autopart.parity.verify import Check, verify_many
from autopart.passes import PIPELINE
from autopart.passes.canonicalize_attention import canonicalize_attention
from autopart.passes.einsum_products import einsum_products
from autopart.passes.tensor_parallel import TPShard

EINSUM = torch.ops.aten.einsum.default


class _Attention(nn.Module):
    """Causal attention written with einsums over [b, s, h, d], heads in the middle."""

    def __init__(self, d: int = 32, heads: int = 4, longest: int = 64) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("tril", torch.tril(torch.ones(longest, longest)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1) for t in self.qkv(x).split(d, -1))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        p = scores.masked_fill(self.tril[:s, :s] == 0, float("-inf")).softmax(-1)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, d))


class _Blocks(nn.Module):
    """Two einsums the pass must leave: a product within blocks of 4 tokens (Mamba-2's
    ``bclhn,bcshn->bclsh``) and one that sums a letter of one operand only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        blocks = x.view(b, s // 4, 4, 4, d // 4)
        g = torch.einsum("bclhn,bcshn->bclsh", blocks, blocks)
        summed = torch.einsum("bqd,bkd->bq", x, x)
        return x * g.mean() + summed.unsqueeze(-1)


class _GPT(nn.Module):
    def __init__(self, mixer: type[nn.Module] = _Attention) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(96, 32), nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), mixer()) for _ in range(2))
        self.mlp = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 96, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = x + block(x)
        return self.head(x + self.mlp(x))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    return ids, torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1)


def _make() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return _GPT(), _batch()


def _rewritten(mixer: type[nn.Module], plan: Plan) -> tuple:
    torch.manual_seed(0)
    captured = capture(_GPT(mixer).double(), _batch())
    gm = copy_graph(captured.graph)
    gm.meta.update(captured.graph.meta)
    return captured, dataclasses.replace(captured, graph=einsum_products(gm, plan))


def _einsums(gm: torch.fx.GraphModule) -> list[str]:
    return [n.args[0] for n in gm.graph.nodes if n.target == EINSUM]


def test_token_pair_einsums_become_matmuls_with_the_same_values() -> None:
    plan = Plan(Mesh(), schedule="seq1f1b", seq_chunks=2, max_seq=64)
    captured, rewritten = _rewritten(_Attention, plan)
    assert len(_einsums(captured.graph)) == 4 and _einsums(rewritten.graph) == []
    want, want_grads = run_graph(captured, _batch())
    got, grads = run_graph(rewritten, _batch())
    assert rel_err(got, want) <= 1e-14
    assert all(rel_err(grads[f], want_grads[f]) <= 1e-13 for f in want_grads)
    # what the rewrite is for: the attention is now proven causal, one SDPA per block
    gm = canonicalize_attention(rewritten.graph, plan)
    marks = [n.meta[META_ATTENTION] for n in gm.graph.nodes if META_ATTENTION in n.meta]
    assert marks == ["causal", "causal"]
    # and tp splits its heads: the fused QKV by strided columns, the output by rows
    tp = run_passes(copy_graph(captured.graph), Plan(Mesh(tp=2)), PIPELINE)[0]
    shards = {f: p.meta[META_SHARD] for f, p in params(tp).items()}
    assert shards["blocks.0.1.qkv.weight"] == TPShard(0, 3)
    assert shards["blocks.1.1.out.weight"] == TPShard(1)


def test_einsums_over_blocks_or_with_a_summed_letter_stay() -> None:
    captured, rewritten = _rewritten(_Blocks, Plan(Mesh()))
    assert _einsums(rewritten.graph) == _einsums(captured.graph) != []


def test_einsum_attention_chunks_and_splits_at_one_devices_gradients() -> None:
    reports = verify_many(
        {
            "tp2": Check(_make, tp=2),
            "pp2-seq1f1b-k2": Check(_make, pp=2, schedule="seq1f1b", microbatches=2, seq_chunks=2),
        },
        dtype="float64",
        timeout_s=120,
        via="fork",
    )
    assert_all_pass(reports)
