"""Hugging Face causal LMs autopart was not written against (tests/hf_zoo.py, small random
configs): each plan is correct (float64 parity, or float32 where the model has no float64
kernels) or refused by ``parallelize`` naming the construct; never wrong, never a crashed rank.

Each model is captured once; each case's ranks are forked with the program in memory.
"""

from __future__ import annotations

import hf_zoo
import pytest
from parity_cases import assert_passes

from autopart import AutopartError
from autopart.verify import Check, Report, verify_many

pytestmark = pytest.mark.multirank
SEQ = {"pp": 2, "schedule": "seq1f1b", "seq_chunks": 2, "microbatches": 2}
REFUSED = {  # Seq1F1B refuses them, naming the node that mixes tokens along the sequence
    "opt": "node cumsum (model.decoder): a cumsum along the sequence",
    "bloom": "node softmax (transformer.h.0.self_attention): a softmax over the sequence",
    "gptj": "node cumsum (transformer): a cumsum along the sequence",
}
CASES = {
    **{f"{m}-pp2-1f1b": Check(getattr(hf_zoo, f"make_{m}"), pp=2, microbatches=2) for m in REFUSED},
    **{f"{m}-pp2-seq1f1b": Check(getattr(hf_zoo, f"make_{m}"), **SEQ) for m in REFUSED},
    "falcon-tp2": Check(hf_zoo.make_falcon, tp=2),
    "falcon-pp2-seq1f1b": Check(hf_zoo.make_falcon, **SEQ),
    "falcon-tp2xpp2-seq1f1b": Check(hf_zoo.make_falcon, tp=2, **SEQ),
}  # fmt: skip


@pytest.fixture(scope="module")
def reports() -> dict[str, Report | AutopartError]:
    return verify_many(CASES, dtype="float64", timeout_s=120, via="fork")


@pytest.mark.parametrize("name", list(REFUSED))
def test_seq1f1b_refuses_what_it_cannot_chunk_and_1f1b_trains_it(name: str, reports) -> None:
    """OPT and GPT-J (positions or masks from a running sum over the sequence) and BLOOM (an
    attention form the attention pass does not recognize) trained silently wrong or crashed
    inside a rank under Seq1F1B; parallelize now refuses them, naming the node, and the same
    models pass under 1F1B."""
    assert_passes(reports[f"{name}-pp2-1f1b"])
    refused = reports[f"{name}-pp2-seq1f1b"]
    assert isinstance(refused, AutopartError), refused
    assert f"Seq1F1B cannot chunk {REFUSED[name]}" in refused.message, refused.message


@pytest.mark.parametrize("case", ["falcon-tp2", "falcon-pp2-seq1f1b", "falcon-tp2xpp2-seq1f1b"])
def test_falcon_in_place_adds_are_functionalized(case: str, reports) -> None:
    """Falcon's forward adds in place: every plan failed to save before capture functionalized
    it; Seq1F1B also needed views of the prefixed attention to become reshapes."""
    assert_passes(reports[case])


def test_a_model_without_float64_kernels_is_verified_in_float32() -> None:
    """Mixtral's grouped expert matmuls have no float64 kernel: float64 verify says so and
    offers float32, where tp=2 and pp=2 Seq1F1B pass at its tolerance."""
    checks = {"tp2": Check(hf_zoo.make_mixtral, tp=2), "seq": Check(hf_zoo.make_mixtral, **SEQ)}
    (no64,) = verify_many({"x": checks["tp2"]}, via="fork").values()
    assert isinstance(no64, AutopartError)
    assert "does not run in float64 on one device" in no64.message, no64.message
    assert "--dtype float32, tolerance 1e-05" in no64.hint
    for name, result in verify_many(checks, dtype="float32", timeout_s=120, via="fork").items():
        assert not isinstance(result, AutopartError), (name, result)
        assert result.ok and result.tolerance == 1e-5, (name, str(result))
