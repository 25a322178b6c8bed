"""Hugging Face ``GPT2LMHeadModel`` from a small random config (no download, ever)."""

from __future__ import annotations

import torch


def make(n_layer: int = 2, batch: int = 8, seq: int = 32):
    """Tiny GPT-2 (2 layers, width 32, tied ``wte``/``lm_head``) and an 8 × 32 token batch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=96,
        n_positions=max(64, seq),
        n_embd=32,
        n_layer=n_layer,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[:, -1] = -100
    return model, (input_ids, labels)


def make_deep():
    """The same GPT-2 with 8 blocks: enough for pp=4 × virtual_stages=2."""
    return make(n_layer=8)


def make_long():
    """4 blocks at 256 tokens (a 4 × 256 batch), where Seq1F1B's balanced chunks are unequal."""
    return make(n_layer=4, batch=4, seq=256)
