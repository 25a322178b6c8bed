"""Float64 parity of data parallelism (and float32, GPipe, and a check that must fail).

Each matrix runs as one batch (``verify_many``): each model is built, run on one device and
captured once, and each case's ranks are real processes forked from this one with the compiled
program in memory, meeting over gloo; nothing is mocked. Every case is its own test.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from parity_cases import DP_CASES, NANO, assert_passes, batch

from autopart import AutopartError, verify
from autopart.parity.verify import Report

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def dp_reports() -> dict[str, Report | AutopartError]:
    return batch(DP_CASES)


@pytest.mark.parametrize("case", list(DP_CASES))
def test_float64_parity(case: str, dp_reports: dict) -> None:
    assert_passes(dp_reports[case])
    assert len(dp_reports[case].errors) == 28  # every parameter of the 2-block models, tied once


def test_float32_parity_and_gpipe() -> None:
    report = verify(NANO, dp=2, microbatches=2, schedule="gpipe", dtype="float32", via="fork")
    assert report.ok and report.tolerance == 1e-5, str(report)


def _dropout_model():
    import nanogpt

    return nanogpt.make(dropout=0.2)


def test_verify_fails_when_ranks_disagree_with_one_device() -> None:
    """With dropout the ranks draw autopart's explicit masks and the single-device run draws
    torch's: the runs differ, so parity must fail, and say so, naming the dropout and the fix
    (it used to leave the user to guess)."""
    report = verify(_dropout_model, dp=2, microbatches=1, via="fork")
    assert not report.ok
    assert report.grad_error > 1e-6 and "FAIL" in str(report)
    assert "active dropout" in str(report) and "eval mode" in str(report), str(report)
    assert report.dropout and all("(p=" in d for d in report.dropout)


def test_the_verify_command_says_why_a_model_with_dropout_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``autopart verify`` printed its own lines and left the report's dropout note out: a user
    saw an 86 % gradient error and nothing pointing at dropout. The note follows the plans."""
    from autopart.cli import main

    spec = tmp_path / "dropout_model.py"
    spec.write_text(
        "from autopart.models import nanogpt\n\n\ndef make():\n"
        "    return nanogpt.make(dropout=0.2)\n"
    )
    code = main(["verify", "--model", f"{spec}:make", "--in-memory", "--plans", "dp=2; tp=2"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1 and "FAIL dp=2" in out, out
    assert out.count("note: the model has active dropout") == 1 and "eval mode" in out, out


def test_the_reference_rounds_as_the_captured_graph() -> None:
    """Hugging Face skips its causal mask in an eager call (SDPA's ``is_causal``, keys grouped by
    ``enable_gqa``) and builds it under ``torch.export``: the reference and the graph summed in
    other orders (5e-16 here), which Llama's float32 RMSNorm in a float64 model turned into a
    2.5e-8 embedding-gradient difference at 8 layers × 1024 tokens with no plan at all.
    Eager calls build the mask too now (``capture.masks_as_exported``): a one-rank program of
    the GQA Llama equals the reference bit for bit, loss and every gradient."""
    from autopart.models import zoo

    report = verify(functools.partial(zoo.make, "llama"), via="fork")
    assert report.loss_error == 0.0 and report.grad_error == 0.0, str(report)
