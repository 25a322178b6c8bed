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
