"""The CUDA path: parity on one GPU, on two when a machine has them, and its CPU stand-ins.

**One GPU** (skipped without CUDA): single-rank programs on ``cuda:0`` (NCCL, a world of one),
and ranks sharing the GPU: NCCL refuses two ranks on one device, so they join over gloo and
every message goes through a host copy (``autopart/runtime/staging.py``). float64 parity for
dp, tp + sequence parallelism, pp 1F1B, Seq1F1B, ZB-H1 and recompute; bf16 against the one-device
bf16 run within its tolerance (docs/precision.md); an Inductor-compiled program (Triton).
``python -m benchmarks gpu`` runs these, then the throughput comparison (docs/runtime.md).

**Two GPUs** (skipped with fewer): the same over NCCL, one GPU per rank.

**On every machine**: the host-staging code path with the CPU tensors staged too
(``AUTOPART_HOST_STAGING=1``), the shared-GPU placement rule, and the GPU benchmark's own code on
a tiny model.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from parity_cases import GPT2, LLAMA, LONG, NANO, ROOT, assert_all_pass, assert_passes

from autopart.parity.verify import Check, verify_many
from autopart.runtime import placement, staging

ONE_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

SEQ = {"schedule": "seq1f1b", "seq_chunks": 2, "microbatches": 2}
SHARED = {  # float64, on one GPU
    "nanogpt-1rank": Check(NANO),
    "llama-1rank-selective-recompute": Check(LLAMA, recompute="selective"),
    "nanogpt-dp2": Check(NANO, dp=2, microbatches=2),
    "gpt2-tp2-sp": Check(GPT2, tp=2, sequence_parallel=True),
    "llama-pp2-1f1b": Check(LLAMA, pp=2, microbatches=2),
    "gpt2-pp2-seq1f1b": Check(LONG["hf_gpt2"], pp=2, **SEQ),
    "llama-pp2-zb-h1": Check(LLAMA, pp=2, schedule="zb-h1", microbatches=4),
    "llama-pp2-seq1f1b-full-recompute": Check(LONG["hf_llama"], pp=2, recompute="full", **SEQ),
    "llama-tp2-pp2-sp-seq1f1b-zb": Check(
        LONG["hf_llama"],
        tp=2,
        pp=2,
        sequence_parallel=True,
        **{**SEQ, "schedule": "seq1f1b-zb"},
    ),
}
BF16 = {
    "llama-1rank": Check(LLAMA),
    "gpt2-tp2": Check(GPT2, tp=2),
    "llama-pp2-seq1f1b": Check(LONG["hf_llama"], pp=2, **SEQ),
}


@pytest.fixture(scope="module")
def shared_reports():
    return verify_many(SHARED, dtype="float64", timeout_s=300, device="cuda")


@ONE_GPU
@pytest.mark.multirank
@pytest.mark.parametrize("case", list(SHARED))
def test_one_gpu_float64_parity(case: str, shared_reports: dict) -> None:
    assert_passes(shared_reports[case])


@ONE_GPU
@pytest.mark.multirank
def test_one_gpu_bf16_parity() -> None:
    """bf16 compute with float32 masters, within twice the model's own bf16 error."""
    reports = verify_many(BF16, dtype="bfloat16", timeout_s=300, device="cuda")
    bad = {n: str(r) for n, r in reports.items() if isinstance(r, Exception) or not r.ok}
    assert not bad, bad


@ONE_GPU
@pytest.mark.multirank
def test_one_gpu_inductor_float64_parity() -> None:
    """A stage graph compiled by Inductor into Triton kernels (float64), on one rank."""
    checks = {"nanogpt-1rank": Check(NANO)}
    for report in verify_many(checks, timeout_s=600, compile=True, device="cuda").values():
        assert_passes(report)


def zoo_plans() -> dict:
    from autopart.models import zoo

    return zoo.PLANS


def _zoo(arch: str, plan: str, **more: str) -> Check:
    from autopart.models import zoo

    return Check(f"autopart.models.zoo:{arch}", **zoo.PLANS[plan], **more)


@ONE_GPU
@pytest.mark.multirank
def test_one_gpu_sequence_constructs() -> None:
    """Seq1F1B's newer constructs and multi-head latent attention on ranks sharing one GPU:
    a window-trimmed K/V prefix, a convolution carry, routed experts with data-dependent group
    sizes, soft-capped and chunked attention, ALiBi split by heads under tp, Mamba-2's carried
    scan state, sinks, MLA."""
    float64 = {
        "mistral-window": _zoo("mistral", "pp=2 Seq1F1B k=4"),
        "lfm2-conv-carry": _zoo("lfm2", "pp=2 Seq1F1B k=2"),
        "jetmoe-split-experts": _zoo("jetmoe", "pp=2 Seq1F1B k=2"),
        "gemma2-soft-cap": _zoo("gemma2", "pp=2 Seq1F1B k=2"),
        "llama4-chunked": _zoo("llama4_text", "pp=2 Seq1F1B k=2"),
        "mpt-alibi-per-head": _zoo("mpt", "tp=2×pp=2 Seq1F1B k=2"),
        "mamba2-ssd-state": _zoo("mamba2", "pp=2 Seq1F1B k=4"),
        "falcon_h1-ssd-state": _zoo("falcon_h1", "tp=2×pp=2 Seq1F1B k=2"),
    }
    float32 = {  # grouped matmuls have no float64 CUDA kernel
        "gpt_oss-sinks": _zoo("gpt_oss", "pp=2 Seq1F1B k=2"),
        "deepseek_v3-mla-tp2": _zoo("deepseek_v3", "tp=2"),
        "minicpm3-mla-tp2-pp2": _zoo("minicpm3", "tp=2×pp=2 Seq1F1B k=2"),
    }
    for dtype, checks in (("float64", float64), ("float32", float32)):
        reports = verify_many(checks, dtype=dtype, timeout_s=300, device="cuda")
        bad = {n: str(r) for n, r in reports.items() if isinstance(r, Exception) or not r.ok}
        assert not bad, bad  # each within its own tolerance (float32 islands: 1e-5)


@ONE_GPU
@pytest.mark.multirank
def test_one_gpu_flex_attention() -> None:
    """``attention="flex"`` on CUDA (``autopart/runtime/flex.py``): windows, soft-capping,
    sinks, ALiBi and chunked masks through FlexAttention. float64 uncompiled (torch's dense
    FlexAttention on CUDA), then float32 through Inductor (FlexAttention's Triton kernels)."""
    flex = {"attention": "flex"}
    float64 = {
        "mistral-window": _zoo("mistral", "pp=2 Seq1F1B k=4", **flex),
        "gemma2-soft-cap": _zoo("gemma2", "pp=2 Seq1F1B k=2", **flex),
        "bloom-alibi": _zoo("bloom", "pp=2 Seq1F1B k=2", **flex),
        "llama4-chunked": _zoo("llama4_text", "pp=2 Seq1F1B k=2", **flex),
        "gemma2-tp2": _zoo("gemma2", "tp=2", **flex),
    }
    reports = verify_many(float64, dtype="float64", timeout_s=300, device="cuda")
    bad = {n: str(r) for n, r in reports.items() if isinstance(r, Exception) or not r.ok}
    assert not bad, bad
    seq = zoo_plans()["pp=2 Seq1F1B k=2"]
    compiled = {  # heads of 16: the Triton kernels take no fewer
        f"{name}-compiled": Check(f"{ROOT}/tests/flex_models.py:{name}_wide", **seq, **flex)
        for name in ("gemma2", "gpt_oss")
    }
    reports = verify_many(compiled, dtype="float32", timeout_s=600, compile=True, device="cuda")
    bad = {n: str(r) for n, r in reports.items() if isinstance(r, Exception) or not r.ok}
    assert not bad, bad


# -- two GPUs, NCCL ----------------------------------------------------------------------------

NCCL = {
    "nanogpt-dp2": Check(NANO, dp=2, microbatches=2),
    "gpt2-tp2-sp": Check(GPT2, tp=2, sequence_parallel=True),
    "llama-pp2-1f1b": Check(LLAMA, pp=2, microbatches=2),
    "gpt2-pp2-seq1f1b": Check(LONG["hf_gpt2"], pp=2, **SEQ),
    "llama-pp2-seq1f1b-full-recompute": Check(LONG["hf_llama"], pp=2, recompute="full", **SEQ),
}


@TWO_GPUS
@pytest.mark.multirank
def test_nccl_float64_parity() -> None:
    for report in verify_many(NCCL, dtype="float64", timeout_s=300, device="cuda").values():
        assert_passes(report)


# -- everywhere ----------------------------------------------------------------------------


CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a stand-in for the GPU path, which runs here instead"
)


@CPU_ONLY
@pytest.mark.multirank
@pytest.mark.slow  # suite time; it ran on an H200 (docs/runtime.md)
def test_host_staging_path_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every message through a host copy, as ranks sharing a GPU send theirs (CPU tensors
    staged too): float64 parity for each kind of message — dp buckets and loss, tp collectives
    beyond the shared-memory exchange, pipeline hand-overs with headers, K/V prefixes, tied
    weights."""
    monkeypatch.setenv(staging.FORCE, "1")
    checks = {
        "dp2": Check(NANO, dp=2, microbatches=2),
        "tp2-sp": Check(GPT2, tp=2, sequence_parallel=True),
        "pp2-seq1f1b-zb": Check(LONG["hf_gpt2"], pp=2, **{**SEQ, "schedule": "seq1f1b-zb"}),
    }
    assert_all_pass(verify_many(checks, timeout_s=120, via="fork"))


def test_ranks_share_a_gpu_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """More local ranks than GPUs: each takes GPU local_rank mod count, and the backend is gloo."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert placement.shares_gpu()
    assert placement.backend_for(torch.device("cuda", 0)) == "gloo"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert placement._local_gpu() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert placement.backend_for(torch.device("cuda", 0)) == "nccl"
    assert placement.backend_for(torch.device("cpu")) == "gloo"


@pytest.mark.slow  # the whole benchmark on CPU; the staging path runs by default
@CPU_ONLY
def test_gpu_benchmark_runs_on_cpu(tmp_path) -> None:
    """``python -m benchmarks gpu``'s code on a tiny model on the CPU: autopart's single-rank
    program and eager PyTorch train the same model (the same first loss, bf16 against float32)
    and every figure is written."""
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "benchmarks", "gpu", "--size", "tiny", "--device", "cpu"]
    cmd += ["--no-checks", "--no-compile", "--seq", "32", "--batch", "2", "--steps", "2"]
    cmd += ["--warmup", "1", "--modes", "eager", "autopart", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads(out.read_text())["throughput"]["seq 32 x batch 2"]
    eager, ours = runs["eager"], runs["autopart"]
    assert abs(eager["losses"][0] - ours["losses"][0]) < 2e-2 * eager["losses"][0]
    assert ours["losses"][-1] < ours["losses"][0]  # it trains
    for r in (eager, ours):
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and len(r["losses"]) == 3
    assert "autopart / eager: step time" in proc.stdout
