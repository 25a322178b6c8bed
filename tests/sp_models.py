"""Small float64 LMs for sequence parallelism's probe (tests/passes/test_sequence_parallel.py):
embedding → one construct → LayerNorm → LM head. Each was silently wrong under tp=2 with SP
(``logit_scale`` under tp alone too) until the twenty-third session: a chunk along the
sequence (each rank chunked its own rows), a reduction over ``dim=()`` or ``dim=None`` (every
dim, read as none; or a crash), a scale computed from the activations multiplying the
vocabulary-split logits (its gradient from one vocabulary slice only)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH, SEQ, BATCH = 64, 32, 16, 4


class _OneConstruct(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.gate = nn.Parameter(torch.tensor(0.01))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        if self.kind == "halves_swapped":
            first, second = x.chunk(2, dim=1)
            x = x + torch.cat([second, first], 1)
        elif self.kind == "sum_of_all":
            x = x * (1 + self.gate * x.sum(dim=(), keepdim=True))
        elif self.kind == "max_of_all":
            x = x * (1 + self.gate * x.amax(dim=(), keepdim=True))
        elif self.kind == "mean_of_all":
            x = x + self.gate * x.mean(dim=None, keepdim=True)
        logits = self.head(self.ln(x))
        if self.kind == "logit_scale":  # an auxiliary term folded into the logits
            logits = logits * (1 + x.pow(2).mean())
        return logits


def make(kind: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return _OneConstruct(kind).double(), (tokens[:, :-1].clone(), tokens[:, 1:].clone())


def halves_swapped():
    return make("halves_swapped")


def sum_of_all():
    return make("sum_of_all")


def max_of_all():
    return make("max_of_all")


def mean_of_all():
    return make("mean_of_all")


def logit_scale():
    return make("logit_scale")
