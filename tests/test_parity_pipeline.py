"""Float64 parity of pipeline parallelism and Seq1F1B: cross-sections of their matrices
(the whole matrices: docs/pipeline.md, docs/seq1f1b.md).

Each matrix runs as one batch (``verify_many``): each model is built, run on one device and
captured once, and each case's ranks are real processes forked from this one with the compiled
program in memory, meeting over gloo; nothing is mocked. Every case is its own test.
"""

from __future__ import annotations

import pytest
from parity_cases import (
    PP_CASES,
    PP_DEFAULT,
    SEQ1F1B_CASES,
    SEQ1F1B_DEFAULT,
    ZB_CASES,
    ZB_DEFAULT,
    assert_all_pass,
    assert_passes,
    batch,
)

from autopart import AutopartError
from autopart.parity.verify import Check, Report

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def pp_reports() -> dict[str, Report | AutopartError]:
    return batch({name: Check(PP_CASES[name][0], **PP_CASES[name][1]) for name in PP_DEFAULT})


@pytest.mark.parametrize("case", PP_DEFAULT)
def test_pipeline_float64_parity(case: str, pp_reports: dict) -> None:
    assert_passes(pp_reports[case])


@pytest.mark.slow
def test_pipeline_float64_parity_whole_cross_section() -> None:
    assert_all_pass(batch({name: Check(spec, **kw) for name, (spec, kw) in PP_CASES.items()}))


@pytest.fixture(scope="module")
def seq1f1b_reports() -> dict[str, Report | AutopartError]:
    return batch(
        {
            name: Check(*SEQ1F1B_CASES[name][:1], **SEQ1F1B_CASES[name][1])
            for name in SEQ1F1B_DEFAULT
        }
    )


@pytest.mark.slow
def test_seq1f1b_float64_parity_whole_cross_section() -> None:
    assert_all_pass(batch({name: Check(spec, **kw) for name, (spec, kw) in SEQ1F1B_CASES.items()}))


@pytest.mark.parametrize("case", SEQ1F1B_DEFAULT)
def test_seq1f1b_float64_parity(case: str, seq1f1b_reports: dict) -> None:
    assert_passes(seq1f1b_reports[case])


@pytest.fixture(scope="module")
def zb_reports() -> dict[str, Report | AutopartError]:
    return batch({name: Check(*ZB_CASES[name][:1], **ZB_CASES[name][1]) for name in ZB_DEFAULT})


@pytest.mark.parametrize("case", ZB_DEFAULT)
def test_zero_bubble_float64_parity(case: str, zb_reports: dict) -> None:
    assert_passes(zb_reports[case])


@pytest.mark.slow
def test_zero_bubble_float64_parity_whole_matrix() -> None:
    """All 26 cases of ZB_CASES (3 models × pp2, pp4, dp2×pp2, tp2×pp2 with SP × ZB-H1 and
    Seq1F1B-ZB k = 2, and two with recomputation), in one batch."""
    assert_all_pass(batch({name: Check(spec, **kw) for name, (spec, kw) in ZB_CASES.items()}))
