"""Seq1F1B through mixtures of experts laid out the ways Hugging Face models lay them out, and
positions read from a buffer (``passes/seq_rules.py``): each construct chunks exactly (float64
loss and every gradient, several cuts, one of a single token); the same model with the
construct broken is refused before any rank runs, naming the node (negative controls)."""

from __future__ import annotations

import pytest
import torch
from test_sequence_chunk import _chunked_exactly
from torch import nn

from autopart import Mesh, parallelize
from autopart.errors import AutopartError
from autopart.frontend.capture import capture

E, K, H = 4, 2, 16  # experts, chosen per token, width
CUTS = ((6, 10), (1, 7, 8))


class _Experts(nn.Module):
    """Embedding, positions, one mixture of 4 experts (2 chosen per token) and a head.

    ``kind``: "split" (JetMoE: the slots per expert counted by a one-hot sum of the chosen
    ids, the sorted rows split by those counts, each expert's rows through its own weights,
    joined in expert order, per-expert biases read by the sorted ids as gpt-oss does, added
    back to their tokens by ``index_add``); "dense" (Llama 4: every token through every
    expert, the tokens repeated once per expert along the merged batch·sequence dim, weighted
    by the router's scores and summed over the experts). Broken: "shuffled" (the experts'
    outputs joined in another order: rows land on other tokens), "folded" (the repeat viewed
    so that one row holds two tokens' copies), "tiled" (a repeat along a dim that is the
    sequence alone, read back as pairs of tokens). ``positions``: "arange" or "buffer" (GPT-1's
    ``position_ids[:, :s]``), "shifted" (a buffer of 1, 2, 3, …: not the positions, but row t is
    still token t's, read at the chunk's rows like any table sliced by the length)."""

    def __init__(self, kind: str, positions: str = "arange") -> None:
        super().__init__()
        self.kind, self.positions = kind, positions
        self.emb, self.pos = nn.Embedding(50, H), nn.Embedding(32, H)
        self.router, self.out = nn.Linear(H, E), nn.Linear(H, 50)
        self.w = nn.Parameter(torch.randn(E, H, H) * 0.3)
        self.bias = nn.Parameter(torch.randn(E, H) * 0.1)
        first = 1 if positions == "shifted" else 0
        self.register_buffer("position_ids", torch.arange(first, 32 + first).view(1, -1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        where = torch.arange(s)[None] if self.positions == "arange" else self.position_ids[:, :s]
        x = (self.emb(ids) + self.pos(where)).view(-1, H)
        logits = self.router(x)
        top, chosen = logits.topk(K, dim=-1)
        if self.kind in ("dense", "folded", "tiled"):
            scores = torch.full_like(logits, float("-inf")).scatter(1, chosen, top).sigmoid()
            rows = x.repeat(E, 1) * scores.t().reshape(-1, 1)
            if self.kind == "folded":  # [E·b·s, H] viewed as [E·b·s / 2, 2H]: tokens paired
                rows = rows.view(-1, 2 * H).flip(-1).reshape(-1, H)
            if self.kind == "tiled":  # [b, s, H] tiled along s itself, then read as pairs
                pairs = x.view(b, s, H).repeat(1, 2, 1).view(b, s, 2, H)
                rows = rows + pairs.sum(2).reshape(-1, H).repeat(E, 1)
            y = (torch.bmm(rows.view(E, -1, H), self.w) + self.bias[:, None]).sum(0)
            return self.out(y.view(b, s, H))
        weights = top.softmax(-1)
        counts = torch.zeros(b * s, E).scatter(1, chosen, 1).long().sum(0)
        sorted_ids, perm = chosen.flatten().sort(0)
        token = perm.div(K, rounding_mode="floor")
        pieces = x[token].split(counts.tolist(), 0)
        outs = [piece @ self.w[e] for e, piece in enumerate(pieces)]
        if self.kind == "shuffled":
            outs = outs[1:] + outs[:1]
        y = (torch.cat(outs, 0) + self.bias[sorted_ids]) * weights.flatten()[perm][:, None]
        if self.kind == "slots":  # back to its slot (JetMoE's attention heads), then per token
            slots = torch.zeros(b * s * K, H, dtype=y.dtype).index_add(0, perm, y)
            return self.out(slots.view(b, s, K, H).sum(2))
        return self.out(torch.zeros(b * s, H, dtype=y.dtype).index_add(0, token, y).view(b, s, H))


@pytest.mark.parametrize(
    ("kind", "positions"),
    [("split", "arange"), ("slots", "arange"), ("dense", "buffer"), ("split", "shifted")],
    ids=["jetmoe", "jetmoe-slots", "llama4", "jetmoe-table"],
)
def test_experts_chunk_exactly(kind: str, positions: str) -> None:
    """JetMoE's split-by-counts experts (with gpt-oss's per-expert biases) and Llama 4's dense
    experts over the repeated tokens; positions from ``arange`` and from a buffer."""
    torch.manual_seed(0)
    _chunked_exactly(_Experts(kind, positions), torch.randint(1, 50, (2, 16)), CUTS)


@pytest.mark.parametrize(
    ("kind", "positions", "node", "why"),
    [
        (
            "shuffled",
            "arange",
            "cat",
            "on tokens reordered by a routing (a sort or a nonzero) along the",
        ),
        ("folded", "arange", "view", "a view that cuts the sequence across dims"),
        ("tiled", "arange", "repeat", "a repeat along the sequence"),
    ],
)
def test_experts_and_positions_that_mix_tokens_are_refused(
    kind: str, positions: str, node: str, why: str
) -> None:
    """Negative controls: the same model with its experts' outputs joined out of order, or its
    repeated tokens paired across rows, is refused at compile time, naming the node (a table
    read from another row than the token's: ``test_position_masks``' "shifted")."""
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 16))
    with pytest.raises(AutopartError) as err:
        model = _Experts(kind, positions).double()
        parallelize(capture(model, (ids, ids)), Mesh(), schedule="seq1f1b")
    assert f"cannot chunk node {node}" in err.value.message and why in err.value.message, (
        err.value.message
    )
