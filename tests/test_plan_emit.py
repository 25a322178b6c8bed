"""Planner to program (issue 18, part 4): ``autopart plan --model SPEC ... --emit DIR`` compiles
the best plan, ``autopart run DIR`` trains it on real ranks, ``autopart verify --program DIR``
checks its plan against one device; ``parallelize(..., plan=...)`` takes a planner result."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from parity_cases import LONG, NANO

from autopart import AutopartError, Mesh, Plan, parallelize
from autopart.cli import main as cli
from autopart.frontend.capture import capture
from autopart.frontend.spec import build
from autopart.layout import Plan as LayoutPlan
from autopart.planning.planner import search
from autopart.planning.simulate import resolve_shape
from autopart.program.format import read_head


@pytest.mark.multirank
@pytest.mark.slow  # suite time
def test_plan_emit_run_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "best"
    plan_args = ["--model", LONG["nanogpt"], "--gpus", "2", "--global-batch", "4"]
    narrow = ["--schedules", "seq1f1b", "--recompute", "full", "--top", "1", "--no-progress"]
    assert cli(["plan", *plan_args, *narrow, "--emit", str(out)]) == 0
    assert f"to {out}" in capsys.readouterr().out
    plan = LayoutPlan.from_json(read_head(out)["plan"])
    assert plan.schedule == "seq1f1b" and plan.recompute == "full" and plan.mesh.size == 2
    run = subprocess.run(
        [sys.executable, "-m", "autopart", "run", str(out), "--steps", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    steps = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert [s["step"] for s in steps] == [0, 1]
    assert cli(["verify", "--model", LONG["nanogpt"], "--program", str(out), "--in-memory"]) == 0
    assert "PASS (tolerance 1e-09" in capsys.readouterr().out


def test_emit_needs_a_model_and_its_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        cli(["plan", "--shape", "gpt-7b", "--gpus", "8", "--global-batch", "8", "--emit", "x"]) == 2
    )
    assert "--emit compiles the best plan for a real model" in capsys.readouterr().err
    wrong = ["--model", NANO, "--gpus", "2", "--global-batch", "16", "--no-progress"]
    assert cli(["plan", *wrong, "--emit", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "example batch has 8 sequences" in err and "global batch of 16" in err
    assert not (tmp_path / "x").exists()


def test_parallelize_takes_a_planner_result() -> None:
    model, batch = build(NANO)
    captured = capture(model, batch)
    best = search(resolve_shape(NANO), "dgx-a100-80gb", 2, 8, top=1).ranked[0]
    program = parallelize(captured, None, plan=best)
    # the plan searched for, with what compile found of the capture (nanoGPT's position table)
    found = replace(best.plan, max_seq=64)
    assert program.plan == found
    assert parallelize(captured, best.plan.mesh, plan=best.plan).plan == found
    with pytest.raises(AutopartError, match="is not the plan's"):
        parallelize(captured, Mesh(dp=7), plan=best)
    with pytest.raises(AutopartError, match="plan= takes an autopart Plan"):
        parallelize(captured, None, plan={"tp": 2})
    assert Plan is LayoutPlan
