"""Float64 parity of tensor parallelism: 4 models × (tp=2, tp=4, dp=2 × tp=2) × sequence parallel off/on.

Each matrix runs as one batch (``verify_many``): each model is built, run on one device and
captured once, and each case's ranks are real processes forked from this one with the compiled
program in memory, meeting over gloo; nothing is mocked. Every case is its own test.
"""

from __future__ import annotations

import pytest
from parity_cases import TP_CASES, assert_passes, batch

from autopart import AutopartError
from autopart.parity.verify import Report

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def tp_reports() -> dict[str, Report | AutopartError]:
    return batch(TP_CASES)


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_float64_parity(case: str, tp_reports: dict) -> None:
    assert_passes(tp_reports[case])
