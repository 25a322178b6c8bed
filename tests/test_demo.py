"""The README's first command: ``autopart demo`` trains tp=2 × pp=2 × Seq1F1B on the shipped text,
shows a falling loss and a passing parity check, and writes what it says it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # suite time (CI also runs `autopart demo --steps 2` from the wheel)
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "autopart", "demo", "--steps", "12", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "seq1f1b with 2 sequence chunks" in text and "corpus.txt" in text
    assert "(falling)" in text  # the mean of the last 5 steps' losses is below the first 5's
    assert "PASS: loss" in text
    plan = json.loads((out / "program" / "plan.json").read_text())
    assert plan["plan"]["schedule"] == "seq1f1b" and plan["plan"]["seq_chunks"] == 2
    assert plan["world_size"] == 4 and plan["vocab_size"] == 256
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert any(",c1)" in e["name"] for e in events)  # chunk 1 of some micro-batch ran
    png = (out / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
