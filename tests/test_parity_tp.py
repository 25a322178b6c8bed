"""Float64 parity of tensor parallelism: 4 models × (tp=2, tp=4, dp=2 × tp=2) × sequence parallel off/on
(4 of the 24 in the default run, every model, mesh and SP setting at least once; all with -m slow).

Each matrix runs as one batch (``verify_many``): each model is built, run on one device and
captured once, and each case's ranks are real processes forked from this one with the compiled
program in memory, meeting over gloo; nothing is mocked. Every case is its own test.
"""

from __future__ import annotations

import pytest
from parity_cases import TP_CASES, TP_DEFAULT, assert_all_pass, assert_passes, batch

from autopart import AutopartError
from autopart.parity.verify import Report

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def tp_reports() -> dict[str, Report | AutopartError]:
    return batch({name: TP_CASES[name] for name in TP_DEFAULT})


@pytest.mark.parametrize("case", TP_DEFAULT)
def test_tensor_parallel_float64_parity(case: str, tp_reports: dict) -> None:
    assert_passes(tp_reports[case])


@pytest.mark.slow
def test_tensor_parallel_float64_parity_whole_matrix() -> None:
    """All 24 cases in one batch (the default run takes the 8 of TP_DEFAULT: suite time)."""
    assert_all_pass(batch(TP_CASES))
