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
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import print_modes, run_workers, time_modes  # noqa: E402

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
        results[name] = time_modes(runners, x, y, WARMUP, ITERS)
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
        ok &= print_modes("precision", name, res, "fp32", "float32", RTOL)
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker)
    else:
        sys.exit(main())
