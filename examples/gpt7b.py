"""A 7B-shaped GPT (32 blocks, hidden 4096, 32 heads, vocabulary 50304) on the meta device.

No memory is allocated: use it to inspect plans, e.g.
``autopart inspect --model examples/gpt7b.py:make --seq-chunks 4 --seq-len 32768``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nanogpt import GPT, GPTConfig, batch  # noqa: E402


def make():
    """The model on meta and a small meta batch (capture keeps the sequence length symbolic)."""
    cfg = GPTConfig(n_layer=32, n_embd=4096, n_head=32, vocab_size=50304, block_size=32768)
    with torch.device("meta"):
        model = GPT(cfg)
    input_ids, labels = batch(cfg, batch_size=2, seq_len=64)
    return model, (input_ids.to("meta"), labels.to("meta"))
