"""Shared by the benchmarks: run this script again as ``nproc`` torchrun ranks (one thread each)
and read back the JSON result the workers write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_workers(script: str, nproc: int, *extra: str) -> Any | None:
    """``script --worker RESULT_JSON *extra`` on ``nproc`` gloo ranks; the parsed result, or None
    (with the ranks' output on stderr) when torchrun failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            script,
            "--worker",
            out,
            *extra,
        ]
        proc = subprocess.run(
            cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True
        )
        if proc.returncode != 0 or not os.path.exists(out):
            print(proc.stdout + proc.stderr, file=sys.stderr)
            print(f"torchrun failed (exit {proc.returncode})", file=sys.stderr)
            return None
        return json.loads(Path(out).read_text())


ROWS: list[dict[str, Any]] = []  # what ``python -m benchmarks`` prints as one table


def record(
    benchmark: str,
    metric: str,
    ours: float,
    peer: float,
    peer_name: str,
    goal: str = "",
    met: bool | None = None,
    unit: str = "",
) -> None:
    """Keep one comparison row: autopart's figure, the peer's, their ratio and the goal."""
    ROWS.append(
        {
            "benchmark": benchmark,
            "metric": metric,
            "autopart": ours,
            "peer": peer,
            "peer_name": peer_name,
            "ratio": ours / peer if peer else float("nan"),
            "goal": goal,
            "met": met,
            "unit": unit,
        }
    )


def time_modes(runners: dict[str, Any], x: Any, y: Any, warmup: int, iters: int) -> dict[str, Any]:
    """On a worker rank: the runners (one per mode) step on ``(x, y)`` in turn, each after a
    barrier, ``warmup + iters`` times. Returns the step-0 losses, the timed steps' seconds (per
    step, the slower rank) and every rank's peak saved bytes at step 0."""
    import time

    import torch
    import torch.distributed as dist

    modes = list(runners)
    times: dict[str, list[float]] = {m: [] for m in modes}
    loss0, saved = {}, {}
    for i in range(warmup + iters):
        for m, runner in runners.items():
            for p in runner.parameters():
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            loss = runner.step(x, y)
            elapsed = time.perf_counter() - start
            if i == 0:
                loss0[m], saved[m] = float(loss), runner.peak_saved_bytes
            if i >= warmup:
                times[m].append(elapsed)
    t = torch.tensor([times[m] for m in modes], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step, the slower rank counts
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, saved)
    return {"loss0": loss0, "times": t.tolist(), "saved": every}


def print_modes(
    benchmark: str,
    name: str,
    res: dict[str, Any],
    base: str,
    peer_name: str,
    rtol: float,
    after: Any = None,
) -> bool:
    """Print one case of ``time_modes``: per mode the median step and the peak saved bytes per
    rank, each against the ``base`` mode, and record both; ``after(mode, per_rank)`` may print a
    line under a mode's row and return whether it holds. True when the step-0 losses agree to
    ``rtol`` (relative) and every ``after`` held."""
    import statistics

    modes = list(res["loss0"])
    ms = {m: 1e3 * statistics.median(t) for m, t in zip(modes, res["times"], strict=True)}
    ref = res["loss0"][base]
    ok = all(abs(res["loss0"][m] - ref) <= rtol * abs(ref) for m in modes)
    print(f"\n{name}: step-0 losses agree: {'yes' if ok else 'NO'} ({ref:.6f})")
    print(f"  {'mode':<10}{'step ms':>9}{'vs ' + base:>9}   peak saved KiB per rank (vs {base})")
    for m in modes:
        per_rank = [s[m] for s in res["saved"]]
        ratios = [s[m] / s[base] for s in res["saved"]]
        print(
            f"  {m:<10}{ms[m]:>9.1f}{ms[m] / ms[base]:>8.2f}x   "
            + "  ".join(
                f"{b / 1024:>8.0f} ({r:.2f})" for b, r in zip(per_rank, ratios, strict=True)
            )
        )
        if after is not None:
            ok &= after(m, per_rank)
        if m != base:
            worst = max(s[m] for s in res["saved"]) / 2**20
            record(
                benchmark,
                f"{name}: {m} peak saved bytes (worst rank)",
                worst,
                max(s[base] for s in res["saved"]) / 2**20,
                peer_name,
                unit="MiB",
            )
            record(benchmark, f"{name}: {m} step time", ms[m], ms[base], peer_name, unit="ms")
    return ok


def losses_agree(losses: dict[str, float], ref: str, rtol: float) -> bool:
    """The step-0 losses all within ``rtol`` (relative) of ``losses[ref]``; says which way."""
    import sys

    want = losses[ref]
    if any(abs(v - want) > rtol * abs(want) for v in losses.values()):
        print(f"LOSS MISMATCH at step 0: {losses}", file=sys.stderr)
        return False
    print(f"step-0 losses agree (relative tolerance {rtol:g})")
    return True
