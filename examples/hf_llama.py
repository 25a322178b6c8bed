"""Hugging Face ``LlamaForCausalLM`` from a small random config: a gated-MLP (SwiGLU), rotary,
RMSNorm model with grouped-query attention (8 query heads share 4 KV heads). No download."""

from __future__ import annotations

import torch


def make():
    """Tiny Llama (2 layers, width 64, 8 heads / 4 KV heads, untied head) and an 8 × 32 batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (8, 33), generator=g)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[:, -1] = -100
    return model, (input_ids, labels)
