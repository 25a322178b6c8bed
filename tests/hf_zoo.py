"""Hugging Face causal LMs autopart was not written against, from small random configs (nothing
downloaded): factories ``make_<name>() -> (model, (input_ids, labels))`` for verify."""

from __future__ import annotations

import torch

VOCAB, BATCH, SEQ = 96, 4, 32


def _batch(vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    input_ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[:, -1] = -100
    return input_ids, labels


def _build(config_cls, model_cls, **kw):
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0,
                     pad_token_id=0, **kw)  # fmt: skip
    return model_cls(cfg).eval(), _batch()


def make_opt():
    """OPT: learned positions from a cumulative sum over the attention mask."""
    from transformers import OPTConfig, OPTForCausalLM

    return _build(OPTConfig, OPTForCausalLM, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                  num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                  dropout=0.0, attention_dropout=0.0)  # fmt: skip


def make_bloom():
    """BLOOM: ALiBi, its bias built from a cumulative sum over the attention mask."""
    from transformers import BloomConfig, BloomForCausalLM

    return _build(BloomConfig, BloomForCausalLM, hidden_size=32, n_layer=2, n_head=4,
                  hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip


def make_gptj():
    """GPT-J: rotary sin/cos gathered from a table by positions."""
    from transformers import GPTJConfig, GPTJForCausalLM

    return _build(GPTJConfig, GPTJForCausalLM, n_embd=32, n_layer=2, n_head=4, rotary_dim=8,
                  n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip


def make_falcon():
    """Falcon: multi-query attention, parallel attention + MLP, in-place adds in its forward."""
    from transformers import FalconConfig, FalconForCausalLM

    return _build(FalconConfig, FalconForCausalLM, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                  alibi=False, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip


def make_mixtral():
    """Mixtral: a mixture of experts (top-2 routing over 4 experts) in every block."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _build(MixtralConfig, MixtralForCausalLM, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
