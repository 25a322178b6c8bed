"""GPU ranks: float64 parity on CUDA with NCCL (dp, tp, pp 1F1B, Seq1F1B, recompute), bf16, and
a stage graph compiled by Inductor (Triton kernels). Each rank runs on ``cuda:LOCAL_RANK``, so
these need two GPUs; they skip on machines without them (this project's CI has none: see
docs/runtime.md for what ran where)."""

from __future__ import annotations

import pytest
import torch
from parity_cases import GPT2, LLAMA, LONG, NANO, assert_passes

from autopart.parity.verify import Check, verify_many

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

SEQ = {"schedule": "seq1f1b", "seq_chunks": 2, "microbatches": 2}
CASES = {
    "nanogpt-dp2": Check(NANO, dp=2, microbatches=2),
    "gpt2-tp2-sp": Check(GPT2, tp=2, sequence_parallel=True),
    "llama-pp2-1f1b": Check(LLAMA, pp=2, microbatches=2),
    "gpt2-pp2-seq1f1b": Check(LONG["hf_gpt2"], pp=2, **SEQ),
    "llama-pp2-seq1f1b-full-recompute": Check(LONG["hf_llama"], pp=2, recompute="full", **SEQ),
}


@pytest.fixture(scope="module")
def reports():
    return verify_many(CASES, dtype="float64", timeout_s=300, device="cuda")


@pytest.mark.parametrize("case", list(CASES))
def test_nccl_float64_parity(case: str, reports: dict) -> None:
    assert_passes(reports[case])


def test_nccl_bf16_parity() -> None:
    """bf16 compute with float32 masters on GPUs, within twice the model's own bf16 error."""
    checks = {
        "gpt2-tp2": Check(GPT2, tp=2),
        "llama-pp2-seq1f1b": Check(LONG["hf_llama"], pp=2, **SEQ),
    }
    for name, r in verify_many(checks, dtype="bfloat16", timeout_s=300, device="cuda").items():
        assert not isinstance(r, Exception) and r.ok, (name, str(r))


@pytest.mark.slow
def test_inductor_on_gpu_float64_parity() -> None:
    (report,) = verify_many(
        [Check(NANO, pp=2, microbatches=2)], timeout_s=600, compile=True, device="cuda"
    ).values()
    assert_passes(report)
