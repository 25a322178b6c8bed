"""Capture + cost analysis of Megatron's 1T GPT on the meta device (no memory, no weights).

Megatron-LM (Narayanan et al., SC21) trains a 1T-parameter GPT: 128 layers, hidden 25600,
160 heads, vocabulary 51200, sequence 2048. This benchmark builds the nanoGPT-style model of
that shape on meta, captures it with autopart, runs the cost analysis, and compares the total
forward matmul FLOPs with the closed form

    2·b·s·(12·l·h² + V·h)   +   l · 2·b·s²·h   (causal attention: half of 4·b·s²·h)

Target: capture + analysis ≤ 30 s on this 2-core machine; FLOPs within 1 % of the closed form.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from nanogpt import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autopart import analyze, capture  # noqa: E402
from autopart.frontend.cost import evaluate, total  # noqa: E402

from _launch import record  # noqa: E402


def main() -> int:
    layers, h, heads, V, s, b = 128, 25600, 160, 51200, 2048, 1
    start = time.perf_counter()
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=layers, n_embd=h, n_head=heads, vocab_size=V, block_size=s))
        ids = torch.zeros(2, s, dtype=torch.long)
    built = time.perf_counter()
    captured = capture(model, (ids, ids))
    captured_at = time.perf_counter()
    groups = analyze(captured)
    done = time.perf_counter()
    params = sum(g.params for g in groups)
    flops = evaluate(total(g.cost for g in groups).mm_flops, b, s)
    closed = 2 * b * s * (12 * layers * h * h + V * h) + layers * 2 * b * s * s * h
    seconds = done - built
    print(f"model: {params / 1e12:.3f} T parameters on meta (built in {built - start:.1f} s)")
    print(
        f"capture: {captured_at - built:.1f} s, cost analysis: {done - captured_at:.2f} s, "
        f"total {seconds:.1f} s (target ≤ 30 s: {'met' if seconds <= 30 else 'MISSED'})"
    )
    print(
        f"forward matmul FLOPs per sequence: autopart {flops:.6e}, closed form {closed:.6e}, "
        f"ratio {flops / closed:.6f} (target within 1 %: {'met' if abs(flops / closed - 1) <= 0.01 else 'MISSED'})"
    )
    record(
        "capture_1t",
        "1T capture + cost analysis",
        seconds,
        30.0,
        "the 30 s budget",
        "<= 1.0",
        seconds <= 30,
        "s",
    )
    record(
        "capture_1t",
        "forward matmul FLOPs",
        flops,
        closed,
        "Megatron closed form",
        "within 1 %",
        abs(flops / closed - 1) <= 0.01,
    )
    return 0 if seconds <= 30 and abs(flops / closed - 1) <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
