"""Float64 parity of tensor parallelism: 4 models × (tp=2, tp=4, dp=2 × tp=2) × sequence parallel off/on
(4 of the 24 in the default run, every model, mesh and SP setting at least once; all with -m slow).

Each matrix runs as one batch (``verify_many``): each model is built, run on one device and
captured once, and each case's ranks are real processes forked from this one with the compiled
program in memory, meeting over gloo; nothing is mocked. Every case is its own test.
"""

from __future__ import annotations

import pytest
from parity_cases import (
    KV_CASES,
    KV_DEFAULT,
    ODD_CASES,
    ODD_DEFAULT,
    TP_CASES,
    TP_DEFAULT,
    assert_all_pass,
    assert_passes,
    batch,
)

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


@pytest.fixture(scope="module")
def kv_reports() -> dict[str, Report | AutopartError]:
    return batch({name: KV_CASES[name] for name in KV_DEFAULT})


@pytest.mark.parametrize("case", KV_DEFAULT)
def test_fewer_kv_heads_than_tp_float64_parity(case: str, kv_reports: dict) -> None:
    """Replicated key/value heads, each rank reading its own (tensor_parallel.md): Llama's
    repeat_kv with sequence parallelism, an eager attention's products under Seq1F1B."""
    assert_passes(kv_reports[case])


@pytest.mark.slow
def test_fewer_kv_heads_than_tp_float64_parity_whole_matrix() -> None:
    """All of KV_CASES: tp up to 8, Qwen3's float32 key norm, SDPA's enable_gqa, dp × tp,
    tp × pp with Seq1F1B and zero-bubble, keys read outside attention."""
    assert_all_pass(batch(KV_CASES))


@pytest.mark.parametrize("case", ODD_DEFAULT)
def test_sizes_tp_does_not_divide_float64_parity(case: str) -> None:
    """A vocabulary of 97 (tied) and transformers' test sizes (vocabulary 99, MLP width 37) at
    tp=2: each was refused; that part stays whole now, the rest splits."""
    assert_passes(batch({case: ODD_CASES[case]})[case])


@pytest.mark.slow
def test_sizes_tp_does_not_divide_float64_parity_whole_matrix() -> None:
    """All of ODD_CASES: tied and untied, 6 heads at tp=4, dp × tp, tp × pp with Seq1F1B."""
    assert_all_pass(batch(ODD_CASES))
