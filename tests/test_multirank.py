"""Parity on real gloo ranks (torchrun): the acceptance matrix of data parallelism.

Each case launches real processes (a few seconds each); nothing here is mocked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopart import AutopartError, Mesh, parallelize, verify
from autopart.cli import main as cli
from autopart.verify import launch

ROOT = Path(__file__).resolve().parent.parent
NANO, MANUAL, GPT2 = (f"{ROOT}/examples/nanogpt.py:make", f"{ROOT}/examples/nanogpt.py:make_manual",
                      f"{ROOT}/examples/hf_gpt2.py:make")  # fmt: skip
pytestmark = pytest.mark.multirank
sys.path.insert(0, str(ROOT / "examples"))


@pytest.mark.parametrize(
    ("spec", "dp"),
    [(NANO, 2), (NANO, 4), (MANUAL, 2), (MANUAL, 4), (GPT2, 2), (GPT2, 4)],
    ids=["nanogpt-sdpa-dp2", "nanogpt-sdpa-dp4", "nanogpt-manual-dp2", "nanogpt-manual-dp4",
         "hf-gpt2-dp2", "hf-gpt2-dp4"],
)  # fmt: skip
def test_float64_parity(spec: str, dp: int) -> None:
    report = verify(spec, dp=dp, microbatches=2, dtype="float64")
    assert report.ok, str(report)
    assert report.loss_error <= 1e-9 and report.grad_error <= 1e-9
    assert len(report.errors) == 28  # every parameter of the 2-block models, tied weight once


def test_float32_parity_and_gpipe() -> None:
    report = verify(NANO, dp=2, microbatches=2, schedule="gpipe", dtype="float32")
    assert report.ok and report.tolerance == 1e-5, str(report)


def _dropout_model():
    import nanogpt

    return nanogpt.make(dropout=0.2)


def test_verify_fails_when_ranks_disagree_with_one_device() -> None:
    """Dropout draws different masks on every process: parity must fail, and say so."""
    report = verify(_dropout_model, dp=2, microbatches=1)
    assert not report.ok
    assert report.grad_error > 1e-6 and "FAIL" in str(report)


def test_world_size_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    import nanogpt

    model, batch = nanogpt.make()
    parallelize(model, Mesh(dp=2), example_inputs=batch).save(tmp_path / "p")
    with pytest.raises(AutopartError) as err:
        launch(
            1,
            ["-m", "autopart.run", str(tmp_path / "p"), "--steps", "1", "--timeout", "20"],
            timeout_s=30,
        )
    assert "dp(2) * pp(1) * tp(1) = 2 != WORLD_SIZE (1)" in str(err.value)


def test_live_device_mesh_api() -> None:
    out = launch(2, [str(ROOT / "tests" / "live_script.py")], timeout_s=120)
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all(line.endswith("OK") for line in lines), out


def test_cli_run_launches_ranks_and_trains(tmp_path: Path) -> None:
    import nanogpt

    model, batch = nanogpt.make()
    parallelize(model, Mesh(dp=2), example_inputs=batch, microbatches=2).save(tmp_path / "p")
    proc = subprocess.run([sys.executable, "-m", "autopart", "run", str(tmp_path / "p"), "--steps", "4",
                           "--json", "--lr", "1e-2", "--batch-size", "16"],
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)


def test_cli_verify_pass_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["verify", "--model", NANO, "--dp", "2", "--microbatches", "2"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert cli(["verify", "--model", NANO, "--dp", "3"]) == 2  # batch 8 not divisible by 3
    assert "not divisible by dp(3) * microbatches(1) = 3" in capsys.readouterr().err
    assert cli(["verify", "--model", NANO, "--tp", "2"]) == 2
    assert "not supported yet" in capsys.readouterr().err
    assert cli(["verify", "--model", NANO, "--schedule", "1f1f"]) == 2
    assert "did you mean '1f1b'" in capsys.readouterr().err
