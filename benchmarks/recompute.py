"""Activation recomputation on CPU: saved-activation bytes and step time of ``recompute="none"``,
``"selective"`` and ``"full"``, side by side, on 4 gloo ranks (tp=2 × pp=2).

Models (float32, random weights, no download): the test suite's long examples (4 blocks at 256
tokens, batch 4) — nanoGPT with SDPA attention, HF GPT-2 and HF Llama under Seq1F1B (k=2,
sequence parallelism, 2 micro-batches), and nanoGPT with the manual masked-softmax attention
under 1F1B (its b·h·s² scores are materialized, as in 2021 Megatron: what selective
recomputation is for). Memory: each rank's peak bytes held for backward
(``runner.peak_saved_bytes``: autograd's saved tensors plus the inputs a checkpointed region
keeps). Time: median of 5 steps after 2 warm-up, modes alternating, each after a barrier, the
slower rank per step. The peer is the same plan with ``recompute="none"``; the losses of the
three modes must agree to 1e-6 (relative) or the script exits 1. Beside each measured peak: the
simulator's prediction for the same plan (``autopart simulate --model``: each unit's bytes read
off the compiled graphs, added up over the rank's schedule), and its error; the script exits 1
when a prediction is more than 10 % off.

    python benchmarks/recompute.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from autopart.layout import Mesh

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import print_modes, run_workers, time_modes  # noqa: E402

MODES = ("none", "selective", "full")
SEQ = {"schedule": "seq1f1b", "seq_chunks": 2, "microbatches": 2, "sequence_parallel": True}
CASES = {
    "nanoGPT (SDPA), Seq1F1B": (f"{ROOT}/examples/nanogpt.py:make_long", SEQ),
    "HF GPT-2, Seq1F1B": (f"{ROOT}/examples/hf_gpt2.py:make_long", SEQ),
    "HF Llama, Seq1F1B": (f"{ROOT}/examples/hf_llama.py:make_long", SEQ),
    "nanoGPT (manual attention), 1F1B": (
        f"{ROOT}/examples/nanogpt.py:make_long_manual",
        {"microbatches": 2, "sequence_parallel": True},
    ),
}
WARMUP, ITERS, RTOL = 2, 5, 1e-6


def worker(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopart
    from autopart.frontend.capture import capture
    from autopart.frontend.spec import build

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    results = {}
    for name, (spec, plan) in CASES.items():
        model, (x, y) = build(spec)
        captured = capture(model, (x, y))
        runners = {rc: autopart.parallelize(captured, mesh, recompute=rc, **plan) for rc in MODES}
        results[name] = time_modes(runners, x, y, WARMUP, ITERS)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def predicted(spec: str, plan: dict, rc: str) -> list[float]:
    """The simulator's peak saved bytes per pipeline rank for this case (as the workers run it)."""
    from autopart.frontend.capture import capture
    from autopart.frontend.spec import build
    from autopart.layout import Plan
    from autopart.planning.memory import graph_memory
    from autopart.planning.simulate import shape_from_captured, simulate

    model, (x, y) = build(spec)
    captured = capture(model, (x, y))
    kw = {k: v for k, v in plan.items() if k != "microbatches"}
    p = Plan.from_batch(
        x.shape[0], x.shape[0] // plan["microbatches"], tp=2, pp=2, dp=1, recompute=rc, **kw
    )
    sim = simulate(
        shape_from_captured(captured), "dgx-a100-80gb", p, memory=graph_memory(captured, p)
    )
    return [g * 2**30 for g in sim.summary.memory.per_rank_saved_activations]


def main() -> int:
    results = run_workers(__file__, 4)
    if results is None:
        return 2
    print(
        f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 4 ranks "
        "(tp=2 x pp=2), 1 thread/rank (ranks share the cores: expect noise)"
    )
    print("models: examples/*.py:make_long (4 blocks, 256 tokens, batch 4), float32")
    ok = True
    pp_of = [Mesh(pp=2, tp=2).coords(r).pp for r in range(4)]
    for name, res in results.items():
        spec, plan = CASES[name]

        def prediction(rc: str, per_rank: list[int], spec=spec, plan=plan) -> bool:
            want = predicted(spec, plan, rc)
            errors = [abs(want[pp_of[r]] - b) / b for r, b in enumerate(per_rank)]
            print(
                f"  {'':<10}{'':>18}   simulator predicts "
                + "  ".join(f"{want[pp_of[r]] / 1024:>8.0f}      " for r in range(len(per_rank)))
                + f"  (worst error {max(errors):.1%})"
            )
            return max(errors) <= 0.10

        ok &= print_modes("recompute", name, res, "none", 'recompute="none"', RTOL, prediction)
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker)
    else:
        sys.exit(main())
