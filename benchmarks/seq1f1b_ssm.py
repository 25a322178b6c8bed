"""Seq1F1B through a state-space model on CPU: activation memory and step time against 1F1B, pp=2.

Model: HF ``Mamba2ForCausalLM`` from a small random config (4 layers, width 256, 16 heads of
32, state 16, SSD blocks of ``--block`` tokens, vocabulary 1024, float32; no download), the
same seeded weights and one batch of 8 × ``--seq`` random tokens in 8 micro-batches, on 2 gloo
ranks (torchrun, launched here, one thread each). Two programs: autopart ``schedule="1f1b"``
and ``schedule="seq1f1b", seq_chunks=4`` (balanced chunks, whole SSD blocks, each chunk's scan
starting from the state the previous chunk ended with: docs/seq1f1b.md, "State scans").

Memory: peak bytes autograd holds for backward on each rank (``runner.peak_saved_bytes``,
parameters excluded). Theory for equal chunks: (p + k − 1)/(k·p) = 0.625 of 1F1B on stage 0
(it holds p + k − 1 chunks at its peak instead of p micro-batches); goal ≤ 0.70, as for
attention models (``benchmarks/seq1f1b.py``). Time: median of 3 steps after 1 warm-up, the
slower rank. Step-0 losses must agree to 1e-4 (relative) or the script exits 1.

Measured (2-core CPU, torch 2.13, defaults: 1024 tokens, blocks of 64, chunks [256, 256, 256,
256]): stage 0 holds 137.41 MiB for backward against 1F1B's 219.38, 0.626 (theory 0.625);
stage 1 121.93 against 121.70; step 3352 ms against 3225 ms (0.962× 1F1B's speed; 0.878× in
a second run: the step times vary between runs, the bytes repeat); step-0 losses 8.211140 and
8.211139.

    python benchmarks/seq1f1b_ssm.py [--seq 1024] [--block 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import losses_agree, record, run_workers, time_modes  # noqa: E402

BATCH, MICRO, P, K, WARMUP, ITERS, RTOL = 8, 8, 2, 4, 1, 3, 1e-4


def build(seq: int, block: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(
        num_hidden_layers=4,
        hidden_size=256,
        num_heads=16,
        head_dim=32,
        state_size=16,
        n_groups=1,
        expand=2,
        chunk_size=block,
        vocab_size=1024,
    )
    torch.manual_seed(0)
    model = Mamba2ForCausalLM(config).float().eval()
    ids = torch.randint(0, 1024, (BATCH, seq), generator=torch.Generator().manual_seed(1))
    return model, (ids, ids.clone())  # Hugging Face's convention: labels unshifted


def worker(out: str, seq: int, block: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopart

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("pp",))
    model, (x, y) = build(seq, block)
    kw = {"example_inputs": (x, y), "microbatches": MICRO}
    runs = {
        "autopart 1F1B": autopart.parallelize(model, mesh, schedule="1f1b", **kw),
        f"Seq1F1B k={K}": autopart.parallelize(model, mesh, schedule="seq1f1b", seq_chunks=K, **kw),
    }
    result = time_modes(runs, x, y, WARMUP, ITERS)
    seq_run = runs[f"Seq1F1B k={K}"]
    result["chunks"] = [e - a for a, e in seq_run._chunk_bounds(seq)]
    result["block"] = seq_run.plan.seq_block
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main(a: argparse.Namespace) -> int:
    result = run_workers(__file__, P, "--seq", str(a.seq), "--block", str(a.block))
    if result is None:
        return 2
    names = list(result["loss0"])
    ms = [1e3 * statistics.median(t) for t in result["times"]]
    params = sum(p.numel() for p in build(a.seq, a.block)[0].parameters())
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 1 thread/rank")
    print(
        f"model: HF Mamba2ForCausalLM 4 x 256, 16 heads x 32, state 16, SSD blocks of {a.block}, "
        f"{params / 1e6:.2f} M params, float32; batch {BATCH} x {a.seq} in {MICRO} "
        f"micro-batches, pp={P}"
    )
    print(f"Seq1F1B chunks {result['chunks']} tokens (whole blocks of {result['block']})")
    print("\npeak saved-activation bytes (MiB)")
    print(f"  {'rank':<6}" + "".join(f"{n:>18}" for n in names))
    for rank, saved in enumerate(result["saved"]):
        print(f"  {rank:<6}" + "".join(f"{saved[n] / 2**20:>18.2f}" for n in names))
    s0 = [result["saved"][0][n] for n in names]
    ratio, theory = s0[1] / s0[0], (P + K - 1) / (K * P)
    print(
        f"stage 0: Seq1F1B / 1F1B = {ratio:.3f} (theory for equal chunks {theory:.3f}; goal <= "
        f"0.70: {'met' if ratio <= 0.70 else 'MISSED'})"
    )
    record("seq1f1b_ssm", "stage-0 peak saved bytes", s0[1] / 2**20, s0[0] / 2**20,
           "autopart 1F1B", "<= 0.70", ratio <= 0.70, "MiB")  # fmt: skip
    print(f"\nstep time: median of {ITERS} after {WARMUP} warm-up (the slower rank)")
    for n, t in zip(names, ms, strict=True):
        print(
            f"  {n:<16} {t:8.1f} ms/step  vs 1F1B {ms[0] / t:5.3f}x   step-0 loss "
            f"{result['loss0'][n]:.6f}"
        )
    record("seq1f1b_ssm", f"step time at {a.seq} tokens", ms[1], ms[0], "autopart 1F1B",
           unit="ms")  # fmt: skip
    return 0 if losses_agree(result["loss0"], names[0], RTOL) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="RESULT_JSON", help="internal: run as a torchrun rank")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    ap.add_argument("--block", type=int, default=64, help="SSD block (chunk_size, default 64)")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.seq, a.block)
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown, where gloo threads can abort
    sys.exit(main(a))
