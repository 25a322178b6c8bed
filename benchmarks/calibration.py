"""Calibrated simulation: predict a real pipeline run on this machine from measured action costs.

HF GPT-2 (4 blocks, width 256, 8 heads, vocabulary 1024, float32) trains on sequences of 512
tokens, one per micro-batch, with pp=2 on 2 gloo ranks, under 1F1B and Seq1F1B (k = 2). Each
schedule goes through the user's own path, the command line:

1. **profile** — the program compiled for 4 micro-batches runs 4 steps with
   ``autopart run DIR --trace TRACE``: the last step's actions on both ranks, and its wall time;
2. **predict** — ``autopart simulate --measured TRACE --global-batch 8 --json`` replays those
   per-action costs on the schedule IR of 8 micro-batches (``autopart/planning/calibrate.py``);
3. **measure** — the program compiled for 8 micro-batches runs 6 steps with ``autopart run``:
   the median step time of the last 5.

Goal: predicted within 15 % of measured, for both schedules.

    python benchmarks/calibration.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import record  # noqa: E402
from _torchpp import GPT2, gpt2  # noqa: E402

P, SEQ, PROFILE_M, RUN_M, K = 2, 512, 4, 8, 2
PLANS = {"1f1b": dict(schedule="1f1b"), "seq1f1b": dict(schedule="seq1f1b", seq_chunks=K)}


def build(m: int):
    return gpt2(SEQ, m)


def save(name: str, m: int, folder: Path) -> Path:
    import autopart

    model, (x, y) = build(m)
    prog = autopart.parallelize(
        model, autopart.Mesh(pp=P), example_inputs=(x, y), microbatches=m, **PLANS[name]
    )
    prog.save(folder)
    return folder


def autopart_cli(*args: str) -> str:
    """Run ``python -m autopart ARGS`` (one thread per rank, as torchrun sets); its stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "autopart", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"autopart {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def step_times(stdout: str) -> list[float]:
    """The per-step seconds rank 0 prints under ``autopart run --json``."""
    lines = (json.loads(x) for x in stdout.splitlines() if x.startswith('{"step"'))
    return [x["seconds"] for x in lines]


def main() -> int:
    print(
        f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 1 thread/rank "
        "(the cores may be shared with other processes: expect noise)"
    )
    print(
        f"model: HF GPT2LMHeadModel {GPT2['n_layer']} x {GPT2['n_embd']}, V={GPT2['vocab_size']}, "
        f"float32, {SEQ} tokens per micro-batch, pp={P}; profiled at m={PROFILE_M}, "
        f"predicted and measured at m={RUN_M}"
    )
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in PLANS:
            base = Path(tmp) / name
            trace = base / "profile.json"
            autopart_cli(
                "run",
                str(save(name, PROFILE_M, base / "m4")),
                "--steps",
                "4",
                "--json",
                "--trace",
                str(trace),
            )
            pred = json.loads(
                autopart_cli(
                    "simulate", "--measured", str(trace), "--global-batch", str(RUN_M), "--json"
                )
            )
            run = autopart_cli("run", str(save(name, RUN_M, base / "m8")), "--steps", "6", "--json")
            measured = statistics.median(step_times(run)[1:])
            predicted = pred["iteration_s"]
            err = predicted / measured - 1
            ok &= abs(err) <= 0.15
            print(
                f"  {name:<8} predicted {predicted * 1e3:8.1f} ms (bubble "
                f"{pred['bubble_fraction']:.3f}, profiled step {pred['measured']['iteration_s'] * 1e3:.1f} ms "
                f"at m={PROFILE_M})  measured {measured * 1e3:8.1f} ms  error {err:+.1%}  "
                f"({'within' if abs(err) <= 0.15 else 'OUTSIDE'} 15 %)"
            )
            record(
                "calibration",
                f"pp=2 {name} step time, m={RUN_M}",
                predicted * 1e3,
                measured * 1e3,
                "the measured run",
                "within 15 %",
                abs(err) <= 0.15,
                "ms",
            )
    return 0 if ok else 1


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    sys.exit(main())
