"""Mixed precision on CPU: saved-activation bytes and step time of float32 and
``precision="bf16"`` (bf16 compute, float32 masters), side by side, on 4 gloo ranks (tp=2 × pp=2).

Models (random weights, no download): the test suite's long examples (4 blocks at 256 tokens,
batch 4) — nanoGPT (SDPA), HF GPT-2 and HF Llama under Seq1F1B (k=2, sequence parallelism, 2
micro-batches). Memory: each rank's peak bytes held for backward (``runner.peak_saved_bytes``).
Time: median of 5 steps after 2 warm-up, modes alternating, each after a barrier, the slower
rank per step. The peer is the float32 run of the same plan. CPU kernels are not built for bf16
speed: the step times say what this machine does, not what a GPU would; the bytes carry over.
The step-0 losses must agree to 2 % or the script exits 1.

    python benchmarks/precision.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import record, run_workers  # noqa: E402

MODES = ("fp32", "bf16")
SEQ = {"schedule": "seq1f1b", "seq_chunks": 2, "microbatches": 2, "sequence_parallel": True}
CASES = {
    "nanoGPT (SDPA), Seq1F1B": f"{ROOT}/examples/nanogpt.py:make_long",
    "HF GPT-2, Seq1F1B": f"{ROOT}/examples/hf_gpt2.py:make_long",
    "HF Llama, Seq1F1B": f"{ROOT}/examples/hf_llama.py:make_long",
}
WARMUP, ITERS, RTOL = 2, 5, 2e-2


def worker(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopart
    from autopart.frontend.capture import capture, capture_mixed
    from autopart.frontend.spec import build

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    results = {}
    for name, spec in CASES.items():
        model, (x, y) = build(spec)
        runners = {
            "fp32": autopart.parallelize(capture(model, (x, y)), mesh, **SEQ),
            "bf16": autopart.parallelize(
                capture_mixed(model, (x, y)), mesh, precision="bf16", **SEQ
            ),
        }
        times: dict[str, list[float]] = {rc: [] for rc in MODES}
        loss0, saved = {}, {}
        for i in range(WARMUP + ITERS):
            for rc, runner in runners.items():
                for p in runner.parameters():
                    p.grad = None
                dist.barrier()
                start = time.perf_counter()
                loss = runner.step(x, y)
                elapsed = time.perf_counter() - start
                if i == 0:
                    loss0[rc], saved[rc] = float(loss), runner.peak_saved_bytes
                if i >= WARMUP:
                    times[rc].append(elapsed)
        t = torch.tensor([times[rc] for rc in MODES], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step, the slower rank counts
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, saved)
        results[name] = {"loss0": loss0, "times": t.tolist(), "saved": every}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    results = run_workers(__file__, 4)
    if results is None:
        return 2
    print(
        f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 4 ranks "
        "(tp=2 x pp=2), 1 thread/rank (ranks share the cores: expect noise)"
    )
    print("models: examples/*.py:make_long (4 blocks, 256 tokens, batch 4), float32 masters")
    ok = True
    for name, res in results.items():
        ms = {rc: 1e3 * statistics.median(t) for rc, t in zip(MODES, res["times"], strict=True)}
        base = res["loss0"]["fp32"]
        agree = all(abs(res["loss0"][rc] - base) <= RTOL * abs(base) for rc in MODES)
        ok &= agree
        print(f"\n{name}: step-0 losses agree: {'yes' if agree else 'NO'} ({base:.6f})")
        print(f"  {'mode':<10}{'step ms':>9}{'vs fp32':>9}   peak saved KiB per rank (vs fp32)")
        for rc in MODES:
            per_rank = [s[rc] for s in res["saved"]]
            ratios = [s[rc] / s["fp32"] for s in res["saved"]]
            print(
                f"  {rc:<10}{ms[rc]:>9.1f}{ms[rc] / ms['fp32']:>8.2f}x   "
                + "  ".join(
                    f"{b / 1024:>8.0f} ({r:.2f})" for b, r in zip(per_rank, ratios, strict=True)
                )
            )
            if rc != "fp32":
                record(
                    "precision",
                    f"{name}: {rc} peak saved bytes (worst rank)",
                    max(s[rc] for s in res["saved"]) / 2**20,
                    max(s["fp32"] for s in res["saved"]) / 2**20,
                    "float32",
                    unit="MiB",
                )
                record(
                    "precision",
                    f"{name}: {rc} step time",
                    ms[rc],
                    ms["fp32"],
                    "float32",
                    unit="ms",
                )
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker)
    else:
        sys.exit(main())
