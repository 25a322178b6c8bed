"""Hugging Face ``LlamaForCausalLM`` from a small random config: a gated-MLP (SwiGLU), rotary,
RMSNorm model with grouped-query attention (8 query heads share 4 KV heads). No download."""

from __future__ import annotations

import torch


def make(n_layer: int = 2, batch: int = 8, seq: int = 32):
    """Tiny Llama (2 layers, width 64, 8 heads / 4 KV heads, untied head) and an 8 × 32 batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layer,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max(64, seq),
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[:, -1] = -100
    return model, (input_ids, labels)


def make_long():
    """4 layers at 256 tokens (a 4 × 256 batch), where Seq1F1B's balanced chunks are unequal."""
    return make(n_layer=4, batch=4, seq=256)
