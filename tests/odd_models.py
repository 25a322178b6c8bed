"""Sizes tp does not divide (tests/test_parity_tp.py): a vocabulary (the token embedding, the
LM head and the loss stay whole on every tp rank: vocab_parallel), an MLP width or a head count
(that region stays replicated: tensor_parallel), while the rest splits. Small random configs
(GPT-2's real vocabulary, 50257, is odd too; Hugging Face's own test configs use a vocabulary of
99 and an MLP width of 37); no download."""

from __future__ import annotations

import torch

VOCAB, SEQ, BATCH = 97, 32, 4


def _batch(vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def gpt2_vocab97():
    """GPT-2 with its embedding tied to the head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    cfg.embd_pdrop = cfg.attn_pdrop = cfg.resid_pdrop = 0.0
    return GPT2LMHeadModel(cfg), _batch()


def llama_vocab97():
    """Llama with an untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg), _batch()


def nanogpt_vocab97():
    from autopart.models import nanogpt

    return nanogpt.make(vocab_size=VOCAB)


def llama_hf_tester():
    """The sizes of transformers' own Llama tests: vocabulary 99, MLP width 37, 4 heads, 2 of
    them for keys and values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg), _batch(99)


def gpt2_heads6():
    """6 heads of 8: at tp=4 the attention stays replicated, the MLP (192) splits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=96, n_embd=48, n_layer=2, n_head=6, n_positions=64)
    cfg.embd_pdrop = cfg.attn_pdrop = cfg.resid_pdrop = 0.0
    return GPT2LMHeadModel(cfg), _batch(96)
