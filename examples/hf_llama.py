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


PADS = (0, 3, 7, 1, 12, 0, 5, 9)  # left padding of each row of make_padded's batch
DOCS = ((32,), (10, 22), (5, 9, 18), (16, 16), (3, 29), (20, 7, 5), (8, 8, 8, 8), (31, 1))


def make_padded(n_layer: int = 2, seq: int = 32):
    """``make``'s model and batch, left padded: row i starts with ``PADS[i]`` padding tokens
    (``attention_mask`` 0, labels -100), so every row has another length of real tokens."""
    model, (input_ids, labels) = make(n_layer=n_layer, batch=len(PADS), seq=seq)
    mask = torch.ones_like(input_ids)
    for i, pad in enumerate(PADS):
        mask[i, :pad] = 0
    input_ids = input_ids.masked_fill(mask == 0, 0)  # the pad token
    labels = labels.masked_fill(mask == 0, -100)
    return model, {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def make_packed(n_layer: int = 2, seq: int = 32):
    """``make``'s model and batch, each row packing the documents of ``DOCS`` (lengths summing
    to ``seq``): ``position_ids`` restart at 0 with every document, which is what Hugging Face
    builds its document mask from (a token attends to earlier tokens of its own document only);
    the label of a document's last token (the next document's first) is -100."""
    assert all(sum(d) == seq for d in DOCS), "the documents fill each row"
    model, (input_ids, labels) = make(n_layer=n_layer, batch=len(DOCS), seq=seq)
    model.config.use_cache = False  # with a K/V cache, its default call attends across them
    position_ids = torch.zeros_like(input_ids)
    for i, docs in enumerate(DOCS):
        start = 0
        for n in docs:
            position_ids[i, start : start + n] = torch.arange(n)
            labels[i, start + n - 1] = -100
            start += n
    return model, {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
