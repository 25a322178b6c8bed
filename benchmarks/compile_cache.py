"""Compiled ranks: parity in float32 and the compile cache, tp=2 × pp=2 Seq1F1B on HF GPT-2.

The model is ``examples/hf_gpt2.py:make_long`` (4 blocks at 256 tokens, batch 4, float32),
compiled for tp=2 × pp=2 with ``schedule="seq1f1b", seq_chunks=2`` and 2 micro-batches. With an
empty Inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR``) the program runs twice, each run a
new torchrun job of 4 ranks with ``--compile`` for 3 steps; a step's time is the slowest rank's
(rank 0 prints it). Compile time = step 0 − the median of the later steps (step 0 compiles
every stage graph, forward and backward, for each chunk length's dynamic shape). Then
``autopart verify --compile --dtype float32`` checks loss and gradients against one device
(float32 tolerance 1e-5).

    python benchmarks/compile_cache.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from _launch import record  # noqa: E402

PLAN = dict(schedule="seq1f1b", seq_chunks=2, microbatches=2)


def main() -> int:
    import hf_gpt2

    from autopart import Mesh, parallelize
    from autopart.parity.verify import launch, verify

    with tempfile.TemporaryDirectory(prefix="autopart-compile-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        model, batch = hf_gpt2.make_long()
        parallelize(model, Mesh(tp=2, pp=2), example_inputs=batch, **PLAN).save(Path(tmp) / "p")
        compile_s = []
        for run in ("first (empty cache)", "second (warm cache)"):
            out = launch(
                4,
                [
                    "-m",
                    "autopart.runtime.run",
                    str(Path(tmp) / "p"),
                    "--steps",
                    "3",
                    "--json",
                    "--compile",
                    "--timeout",
                    "600",
                ],
                timeout_s=600,
            )
            steps = [json.loads(x) for x in out.splitlines() if x.startswith('{"step"')]
            later = statistics.median(s["seconds"] for s in steps[1:])
            compile_s.append(steps[0]["seconds"] - later)
            print(
                f"{run}: step 0 {steps[0]['seconds']:.1f} s, later steps {later:.2f} s → "
                f"compile {compile_s[-1]:.1f} s"
            )
        print(f"second run's compile time / first's: {compile_s[1] / compile_s[0]:.3f}")
        record(
            "compile_cache",
            "compile time, 4 ranks",
            compile_s[1],
            compile_s[0],
            "the same job with an empty cache",
            "< 1.0",
            compile_s[1] < compile_s[0],
            "s",
        )
        report = verify(
            hf_gpt2.__file__ + ":make_long",
            tp=2,
            pp=2,
            dtype="float32",
            compile=True,
            timeout_s=600,
            **PLAN,
        )
    print(
        f"compiled parity (float32): loss rel err {report.loss_error:.1e}, worst gradient "
        f"{report.worst} {report.grad_error:.1e} (tolerance {report.tolerance:.0e}): "
        f"{'PASS' if report.ok else 'FAIL'}"
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
