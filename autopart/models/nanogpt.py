"""A nanoGPT-style GPT written for autopart's tests and demo (``autopart demo`` trains it; it
ships with the package so the demo runs from a plain install; ``examples/nanogpt.py`` re-exports
it as a model SPEC: ``examples/nanogpt.py:make``).

Token + learned position embeddings, pre-norm blocks with a fused-QKV causal self-attention
(``F.scaled_dot_product_attention`` or a manual masked softmax over a registered causal-mask
buffer), a GELU MLP, a final LayerNorm and an LM head tied to the token embedding.

``make()`` / ``make_manual()`` are factories of the shape autopart takes everywhere:
``make() -> (model, (input_ids, labels))`` with int64 token tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "GPTConfig",
    "batch",
    "demo",
    "make",
    "make_deep",
    "make_long",
    "make_long_manual",
    "make_manual",
]


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"  # "sdpa" or "manual"


class CausalSelfAttention(nn.Module):
    bias: torch.Tensor  # the causal mask, a buffer (manual attention only)

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.manual = cfg.attention == "manual"
        if self.manual:
            mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size))
            self.register_buffer("bias", mask.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.manual:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v  # (B, nh, T, hs)
        else:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        # nanoGPT's layout (its parameter names); torch types ModuleDict's attributes loosely
        self.transformer: Any = nn.ModuleDict(
            dict(
                wte=wte,
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        wte.weight = self.lm_head.weight  # weight tying
        if wte.weight.device.type != "meta":
            self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (t,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (b, t, vocab)


def batch(cfg: GPTConfig, batch_size: int = 8, seq_len: int | None = None, seed: int = 0):
    """Random next-token batch: labels are the inputs shifted left, the last position ignored;
    ``seq_len`` defaults to 32 tokens, or the model's ``block_size`` if shorter."""
    seq_len = min(32, cfg.block_size) if seq_len is None else seq_len
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), generator=g)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[:, -1] = -100
    return input_ids, labels


def make(attention: str = "sdpa", **overrides):
    """Small GPT (2 blocks, width 32) and an 8 × 32 token batch; same weights every call."""
    cfg = GPTConfig(attention=attention, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg)
    return model, batch(cfg)


def make_manual():
    """The same GPT with the manual masked-softmax attention path."""
    return make(attention="manual")


def make_deep():
    """The same GPT with 8 blocks: enough for pp=4 × virtual_stages=2 (one block per stage)."""
    return make(n_layer=8)


def make_long(attention: str = "sdpa"):
    """4 blocks at 256 tokens (a 4 × 256 batch): attention is a large share of the work, so
    Seq1F1B's balanced chunks differ from equal ones (k=2: 152 + 104 tokens)."""
    # block_size above the example length: at exactly block_size torch.export may drop the
    # manual path's mask slice (bias[:, :, :T, :T]) as a no-op, fixing the graph to 256 tokens
    cfg = GPTConfig(attention=attention, n_layer=4, block_size=512)
    torch.manual_seed(0)
    return GPT(cfg), batch(cfg, batch_size=4, seq_len=256)


def make_long_manual():
    """``make_long`` with the manual masked-softmax attention path."""
    return make_long(attention="manual")


def demo():
    """The model of ``autopart demo`` and ``autopart train``'s default: a byte-level GPT
    (vocabulary 256, 4 blocks, width 64, positions for 256 tokens) and an 8 × 64 batch."""
    cfg = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=256)
    torch.manual_seed(0)
    return GPT(cfg), batch(cfg, batch_size=8, seq_len=64)
