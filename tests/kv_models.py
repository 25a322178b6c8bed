"""Attention with fewer key/value heads than tp (tests/test_parity_tp.py and the
tensor_parallel pass tests): each rank keeps the key/value projections whole and selects the
heads its query heads read. Small random configs in float32 (verify casts); no download."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQ, BATCH = 96, 64, 32, 4


def _batch(seq: int = SEQ, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def _hf(kind: str, kv: int, n_layer: int = 2, seq: int = SEQ):
    import transformers

    config = getattr(transformers, f"{kind}Config")(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=n_layer,
        num_attention_heads=8,
        num_key_value_heads=kv,
        head_dim=8,
        max_position_embeddings=max(64, seq),
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return getattr(transformers, f"{kind}ForCausalLM")(config), _batch(seq)


def llama_mqa():
    """HF Llama with one key/value head for 8 query heads (multi-query attention)."""
    return _hf("Llama", 1)


def llama_mqa_long():
    """``llama_mqa`` with 4 layers at 128 tokens (Seq1F1B with 4 chunks beside tp)."""
    return _hf("Llama", 1, n_layer=4, seq=128)


def llama_kv2():
    """HF Llama with 2 key/value heads for 8 query heads (tp = 4 or 8 replicates them)."""
    return _hf("Llama", 2)


def qwen3_mqa():
    """HF Qwen3 with one key/value head: its per-head key norm computes in float32, so in a
    float64 run the ranks' gradient shares are summed before that norm rounds them."""
    return _hf("Qwen3", 1)


class _Attention(nn.Module):
    """Causal attention with ``kv`` key/value heads read by SDPA's ``enable_gqa`` (no repeat),
    v projected before k and k normalized per head (the cut of v then comes before k's);
    ``leak`` also adds the mean of the keys to the output (the keys have a use outside
    attention, so the key chain is summed over tp where that use joins it)."""

    def __init__(self, heads: int, kv: int, leak: bool) -> None:
        super().__init__()
        self.heads, self.kv, self.dim, self.leak = heads, kv, 8, leak
        self.q = nn.Linear(WIDTH, heads * self.dim)
        self.k = nn.Linear(WIDTH, kv * self.dim)
        self.v = nn.Linear(WIDTH, kv * self.dim)
        self.o = nn.Linear(heads * self.dim, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv, self.dim).transpose(1, 2)  # v before k: the two
        k = self.k(x).view(b, s, self.kv, self.dim)  # cuts sit in the other order
        k = F.layer_norm(k, (self.dim,)).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out = self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.dim))
        if self.leak:
            out = out + k.mean(dim=(1, 3)).unsqueeze(-1)
        return out


class _Eager(_Attention):
    """Eager attention over repeated key/value heads with Gemma 2's logit soft-capping (which
    keeps it as matmuls, softmax and matmuls rather than one SDPA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        rep = self.heads // self.kv
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = (
            f(x)
            .view(b, s, self.kv, self.dim)
            .transpose(1, 2)[:, :, None]
            .expand(b, self.kv, rep, s, self.dim)
            .reshape(b, self.heads, s, self.dim)
            for f in (self.k, self.v)
        )
        scores = torch.tanh(q @ k.transpose(-1, -2) / (self.dim**0.5 * 30.0)) * 30.0
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, self.heads * self.dim))


class _Repeated(_Attention):
    """SDPA over key/value heads repeated by hand, as hand-written GPTs do: ``interleave``
    (``k.repeat_interleave(rep, dim=1)``: query head j reads key head j // rep, GQA) or not
    (``k.repeat(1, rep, 1, 1)``: the heads tiled, query head j reads key head j % kv, which a
    rank's block of query heads does not read from its block of key heads)."""

    def __init__(self, heads: int, kv: int, interleave: bool) -> None:
        super().__init__(heads, kv, leak=False)
        self.interleave = interleave

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        rep = self.heads // self.kv
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = (f(x).view(b, s, self.kv, self.dim).transpose(1, 2) for f in (self.k, self.v))
        if self.interleave:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        else:
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.dim))


class _Model(nn.Module):
    def __init__(
        self,
        heads: int,
        kv: int,
        leak: bool = False,
        n_layer: int = 2,
        eager: bool = False,
        repeat: str = "",
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(n_layer))
        if repeat:
            self.attn = nn.ModuleList(
                _Repeated(heads, kv, repeat == "interleave") for _ in range(n_layer)
            )
            self.head = nn.Linear(WIDTH, VOCAB)
            return
        kind = _Eager if eager else _Attention
        self.attn = nn.ModuleList(kind(heads, kv, leak) for _ in range(n_layer))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for norm, attn in zip(self.norms, self.attn, strict=True):
            x = x + attn(norm(x))
        return self.head(x)


def _toy(heads: int, kv: int, leak: bool = False, eager: bool = False, repeat: str = ""):
    torch.manual_seed(0)
    return _Model(heads, kv, leak, eager=eager, repeat=repeat), _batch()


def eager_mqa():
    """8 query heads over 1 repeated key/value head in eager, soft-capped attention."""
    return _toy(8, 1, eager=True)


def eager_kv3():
    """6 query heads over 3 repeated key/value heads in eager attention (tp = 2 and 3 cut the
    repeated heads, not the 3)."""
    return _toy(6, 3, eager=True)


def gqa_kv1():
    """8 query heads, 1 key/value head, ``enable_gqa``."""
    return _toy(8, 1)


def gqa_kv2():
    """8 query heads, 2 key/value heads, ``enable_gqa`` (tp = 4: two ranks share each)."""
    return _toy(8, 2)


def gqa_kv3():
    """6 query heads, 3 key/value heads, ``enable_gqa``: tp = 2 neither divides 3 nor is a
    multiple of it, so the attention stays replicated (with a warning)."""
    return _toy(6, 3)


def gqa_leak():
    """``gqa_kv1`` whose keys are read outside attention as well."""
    return _toy(8, 1, leak=True)


def interleave_kv2():
    """8 query heads over 2 key/value heads repeated by ``repeat_interleave`` (GQA written by
    hand): tp = 2 splits the key/value heads with the query heads they serve."""
    return _toy(8, 2, repeat="interleave")


def interleave_kv1():
    """8 query heads over 1 key/value head repeated by ``repeat_interleave``: tp = 4 keeps it
    whole and each rank selects its 2 of the 8 repeated heads."""
    return _toy(8, 1, repeat="interleave")


def tiled_kv2():
    """8 query heads over 2 key/value heads tiled by ``repeat`` (head j reads j % 2): no rank's
    block of key heads serves its block of query heads, so the attention stays replicated."""
    return _toy(8, 2, repeat="tile")
