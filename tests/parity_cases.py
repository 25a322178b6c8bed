"""The parity matrices' cases (plain data) and how a matrix runs: one batch per matrix.

Shared by tests/test_parity*.py and tests/test_multirank.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autopart import AutopartError
from autopart.parity.verify import Check, Report, verify_many

ROOT = Path(__file__).resolve().parent.parent
NANO, MANUAL, GPT2 = (
    f"{ROOT}/examples/nanogpt.py:make",
    f"{ROOT}/examples/nanogpt.py:make_manual",
    f"{ROOT}/examples/hf_gpt2.py:make",
)

DP_CASES = {
    f"{name}-dp{dp}": Check(spec, dp=dp, microbatches=2)
    for name, spec in (("nanogpt-sdpa", NANO), ("nanogpt-manual", MANUAL), ("hf-gpt2", GPT2))
    for dp in (2, 4)
}


def selects_slow(config: Any) -> bool:
    """Whether this run selects ``slow`` tests (``-m slow``, or no ``not slow``): a matrix's
    fixture then runs its whole batch, else the default suite's cross-section."""
    return "not slow" not in config.getoption("-m")


def cross_section(cases: list[str], default: list[str]) -> list[Any]:
    """``cases`` as pytest parameters, those outside ``default`` marked ``slow``."""
    return [c if c in default else pytest.param(c, marks=pytest.mark.slow) for c in cases]


def batch(cases: dict[str, Check]) -> dict[str, Report | AutopartError]:
    """Every case of a matrix in one batch: each model captured once, forked ranks."""
    return verify_many(cases, dtype="float64", timeout_s=120, via="fork")


def assert_all_pass(reports: dict[str, Report | AutopartError]) -> None:
    """Every case of a whole matrix passes; the failures are named together."""
    failed = []
    for name, report in reports.items():
        try:
            assert_passes(report)
        except (AssertionError, AutopartError) as exc:
            failed.append(f"{name}: {str(exc).splitlines()[0]}")
    assert not failed, "\n".join(failed)


def assert_passes(result: Report | AutopartError) -> None:
    if isinstance(result, AutopartError):
        raise result
    assert result.ok, str(result)
    assert result.loss_error <= 1e-9 and result.grad_error <= 1e-9
    assert result.tolerance == 1e-9


LLAMA = f"{ROOT}/examples/hf_llama.py:make"
TP_MODELS = {"nanogpt-sdpa": NANO, "nanogpt-manual": MANUAL, "hf-gpt2": GPT2, "hf-llama-gqa": LLAMA}
TP_MESHES = {"tp2": {"tp": 2}, "tp4": {"tp": 4}, "dp2xtp2": {"dp": 2, "tp": 2, "microbatches": 2}}


TP_CASES = {  # the whole matrix runs with -m slow; TP_DEFAULT is the default suite's cross-section
    f"{model}-{mesh}-sp-{'on' if sp else 'off'}": Check(
        TP_MODELS[model], sequence_parallel=sp, **TP_MESHES[mesh]
    )
    for model in TP_MODELS
    for mesh in TP_MESHES
    for sp in (False, True)
}


# every model, every mesh and SP on and off at least once (suite time: 4 of 24)
TP_DEFAULT = [
    "nanogpt-sdpa-dp2xtp2-sp-on",
    "nanogpt-manual-tp4-sp-on",
    "hf-gpt2-tp2-sp-off",
    "hf-llama-gqa-tp2-sp-on",
]


KV = f"{ROOT}/tests/kv_models.py"
KV_CASES = {  # fewer key/value heads than tp: replicated and selected per rank (tensor_parallel.md)
    "llama-mqa-tp2": Check(f"{KV}:llama_mqa", tp=2),
    "llama-mqa-tp4-sp": Check(f"{KV}:llama_mqa", tp=4, sequence_parallel=True),
    "llama-mqa-tp8": Check(f"{KV}:llama_mqa", tp=8),
    "llama-gqa4-tp8": Check(LLAMA, tp=8),
    "llama-kv2-tp4": Check(f"{KV}:llama_kv2", tp=4),
    "qwen3-mqa-tp2": Check(f"{KV}:qwen3_mqa", tp=2),
    "gqa-kv1-tp4": Check(f"{KV}:gqa_kv1", tp=4),
    "gqa-kv2-tp4-sp": Check(f"{KV}:gqa_kv2", tp=4, sequence_parallel=True),
    "gqa-leak-tp2": Check(f"{KV}:gqa_leak", tp=2),
    "interleave-kv2-tp2-sp": Check(f"{KV}:interleave_kv2", tp=2, sequence_parallel=True),
    "interleave-kv1-tp4": Check(f"{KV}:interleave_kv1", tp=4),
    "interleave-kv2-tp2xpp2-seq1f1b-k2": Check(
        f"{KV}:interleave_kv2", tp=2, pp=2, schedule="seq1f1b", seq_chunks=2, microbatches=4
    ),
    "tiled-kv2-tp2": Check(f"{KV}:tiled_kv2", tp=2),
    "llama-mqa-dp2xtp2": Check(f"{KV}:llama_mqa", dp=2, tp=2, microbatches=2),
    "llama-mqa-tp2xpp2-seq1f1b-k4-sp": Check(
        f"{KV}:llama_mqa_long",
        tp=2,
        pp=2,
        schedule="seq1f1b",
        seq_chunks=4,
        microbatches=4,
        sequence_parallel=True,
    ),
    "eager-mqa-tp4-sp": Check(f"{KV}:eager_mqa", tp=4, sequence_parallel=True),
    "eager-kv3-tp2": Check(f"{KV}:eager_kv3", tp=2),
    "eager-mqa-tp2xpp2-seq1f1b-k2": Check(
        f"{KV}:eager_mqa", tp=2, pp=2, schedule="seq1f1b", seq_chunks=2, microbatches=4
    ),
    "zoo-mistral-tp4xpp2-seq1f1b-k4": Check(
        "autopart.models.zoo:mistral", tp=4, pp=2, schedule="seq1f1b", seq_chunks=4, microbatches=4
    ),
    "llama-mqa-tp2xpp2-zb": Check(
        f"{KV}:llama_mqa_long", tp=2, pp=2, schedule="zb-h1", microbatches=4
    ),
}
# the default suite's cross-section (suite time): repeat_kv with sp, an eager attention's
# products under Seq1F1B, repeat_interleave with sp; the float32 key norm and enable_gqa with -m slow (their graphs are
# checked in tests/passes/test_tensor_parallel.py by default)
KV_DEFAULT = ["llama-mqa-tp4-sp", "eager-mqa-tp2xpp2-seq1f1b-k2", "interleave-kv2-tp2-sp"]


ODD = f"{ROOT}/tests/odd_models.py"
ODD_CASES = {  # sizes tp does not divide: that part stays whole, the rest splits
    "gpt2-vocab97-tp2": Check(f"{ODD}:gpt2_vocab97", tp=2),
    "llama-hf-tester-tp2": Check(f"{ODD}:llama_hf_tester", tp=2),
    "llama-vocab97-tp4": Check(f"{ODD}:llama_vocab97", tp=4),
    "gpt2-heads6-tp4": Check(f"{ODD}:gpt2_heads6", tp=4),
    "nanogpt-vocab97-dp2xtp2": Check(f"{ODD}:nanogpt_vocab97", dp=2, tp=2, microbatches=2),
    "llama-vocab97-tp2xpp2-seq1f1b-k2": Check(
        f"{ODD}:llama_vocab97", tp=2, pp=2, schedule="seq1f1b", seq_chunks=2, microbatches=4
    ),
    "llama-hf-tester-tp2xpp2-seq1f1b-k2": Check(
        f"{ODD}:llama_hf_tester", tp=2, pp=2, schedule="seq1f1b", seq_chunks=2, microbatches=4
    ),
    # sequence parallelism around a whole vocabulary (tp_split / tp_join)
    "gpt2-vocab97-tp2-sp": Check(f"{ODD}:gpt2_vocab97", tp=2, sequence_parallel=True),
    "gpt2-vocab97-tp2xpp2-sp-seq1f1b-k2": Check(
        f"{ODD}:gpt2_vocab97",
        tp=2,
        pp=2,
        schedule="seq1f1b",
        seq_chunks=2,
        microbatches=4,
        sequence_parallel=True,
    ),
    "gpt2-vocab97-dp2xtp2-sp": Check(
        f"{ODD}:gpt2_vocab97", dp=2, tp=2, microbatches=2, sequence_parallel=True
    ),
    "llama-hf-tester-tp2xpp2-sp-seq1f1b-k2": Check(
        f"{ODD}:llama_hf_tester",
        tp=2,
        pp=2,
        schedule="seq1f1b",
        seq_chunks=2,
        microbatches=4,
        sequence_parallel=True,
    ),
}
# tied vocabulary 97 (alone and with sequence parallelism), and transformers' own test sizes
# (vocabulary 99, MLP 37); the rest with -m slow (suite time)
ODD_DEFAULT = ["gpt2-vocab97-tp2", "gpt2-vocab97-tp2-sp", "llama-hf-tester-tp2"]


NANO_DEEP, GPT2_DEEP = (
    f"{ROOT}/examples/nanogpt.py:make_deep",
    f"{ROOT}/examples/hf_gpt2.py:make_deep",
)
PP_CASES = {  # a cross-section of the acceptance matrix (the whole matrix: docs/pipeline.md)
    "nanogpt-pp2-1f1b-m4": (NANO_DEEP, {"pp": 2, "schedule": "1f1b", "microbatches": 4}),
    "nanogpt-pp4-gpipe-m8": (NANO_DEEP, {"pp": 4, "schedule": "gpipe", "microbatches": 8}),
    "nanogpt-pp2-interleaved-v2-m4": (
        NANO_DEEP,
        {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": 4},
    ),
    "gpt2-pp4-interleaved-v2-m8": (
        GPT2_DEEP,
        {"pp": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": 8},
    ),
    "gpt2-pp2-1f1b-m8": (GPT2_DEEP, {"pp": 2, "schedule": "1f1b", "microbatches": 8}),
    "gpt2-pp4-1f1b-m4": (GPT2_DEEP, {"pp": 4, "schedule": "1f1b", "microbatches": 4}),
    "gpt2-dp2xpp2-1f1b-m2": (GPT2, {"dp": 2, "pp": 2, "microbatches": 2}),
    "llama-tp2xpp2-sp-m4": (
        LLAMA,
        {"tp": 2, "pp": 2, "microbatches": 4, "sequence_parallel": True},
    ),
}


# the default suite's cross-section of PP_CASES (interleaved pp=4, tp beside pp; 1F1B and dp
# beside pp run in the other default batches); all of them with -m slow
PP_DEFAULT = ["gpt2-pp4-interleaved-v2-m8", "llama-tp2xpp2-sp-m4"]


LONG = {m: f"{ROOT}/examples/{m}.py:make_long" for m in ("nanogpt", "hf_gpt2", "hf_llama")}
MANUAL_LONG = f"{ROOT}/examples/nanogpt.py:make_long_manual"
SEQ = {"schedule": "seq1f1b"}
SEQ1F1B_CASES = {  # a cross-section of the acceptance matrix (the whole matrix: docs/seq1f1b.md)
    # SEQ1F1B_DEFAULT in the default suite, all of them with -m slow
    "nanogpt-pp2-k2-balanced": (
        LONG["nanogpt"],
        {**SEQ, "pp": 2, "seq_chunks": 2, "microbatches": 4},
    ),
    "nanogpt-manual-pp4-k4-uniform": (
        MANUAL_LONG,
        {**SEQ, "pp": 4, "seq_chunks": 4, "seq_split": "uniform", "microbatches": 4},
    ),
    "gpt2-pp2-k4-balanced": (LONG["hf_gpt2"], {**SEQ, "pp": 2, "seq_chunks": 4, "microbatches": 2}),
    "gpt2-pp4-k2-uniform": (
        LONG["hf_gpt2"],
        {**SEQ, "pp": 4, "seq_chunks": 2, "seq_split": "uniform", "microbatches": 4},
    ),
    "llama-pp2-k4-balanced": (
        LONG["hf_llama"],
        {**SEQ, "pp": 2, "seq_chunks": 4, "microbatches": 4},
    ),
    # tp2 x pp2 with SP (HF GPT-2: head counts are expressions of s in the graph) on GPT-2 and
    # Llama: RECOMPUTE_CASES' "-none" rows, which run exactly these plans
    "gpt2-pp2-v2-k2-interleaved": (
        LONG["hf_gpt2"],
        {
            "schedule": "seq1f1b-interleaved",
            "pp": 2,
            "virtual_stages": 2,
            "seq_chunks": 2,
            "microbatches": 4,
        },
    ),
    "nanogpt-dp2xpp2-k2": (
        LONG["nanogpt"],
        {**SEQ, "dp": 2, "pp": 2, "seq_chunks": 2, "microbatches": 2},
    ),
    # 32 chunks of 8 tokens: message tags had room for 16 (the step failed after compiling)
    "nanogpt-pp2-k32-uniform": (
        LONG["nanogpt"],
        {**SEQ, "pp": 2, "seq_chunks": 32, "seq_split": "uniform", "microbatches": 2},
    ),
}


TP2XPP2_SEQ = {
    **SEQ,
    "tp": 2,
    "pp": 2,
    "seq_chunks": 2,
    "microbatches": 2,
    "sequence_parallel": True,
}
RECOMPUTE_CASES = {  # issue 18's matrix: every model x recompute mode under tp2 x pp2 Seq1F1B
    f"{model}-{rc}": (LONG[model], {**TP2XPP2_SEQ, "recompute": rc})
    for model in ("nanogpt", "hf_gpt2", "hf_llama")
    for rc in ("none", "selective", "full")
}
RECOMPUTE_CASES |= {  # materialized attention scores (1F1B keeps the manual softmax path)
    f"nanogpt_manual-1f1b-{rc}": (
        MANUAL_LONG,
        {"tp": 2, "pp": 2, "microbatches": 2, "sequence_parallel": True, "recompute": rc},
    )
    for rc in ("none", "selective")
}


SEQ1F1B_DEFAULT = ["llama-pp2-k4-balanced", "gpt2-pp2-v2-k2-interleaved", "nanogpt-pp2-k32-uniform"]


# zero-bubble schedules (issue 20): every model × every mesh of pp = 2 and 4 on ≤ 4 ranks ×
# both split schedules; ZB_DEFAULT is the cross-section the default suite runs
ZB_MODELS = {"nanogpt": NANO_DEEP, "hf-gpt2": GPT2_DEEP, "hf-llama": LONG["hf_llama"]}
ZB_LONG = {"nanogpt": LONG["nanogpt"], "hf-gpt2": LONG["hf_gpt2"], "hf-llama": LONG["hf_llama"]}
ZB_MESHES = {
    "pp2": {"pp": 2, "microbatches": 4},
    "pp4": {"pp": 4, "microbatches": 4},
    "dp2xpp2": {"dp": 2, "pp": 2, "microbatches": 2},
    "tp2xpp2": {"tp": 2, "pp": 2, "microbatches": 4, "sequence_parallel": True},
}
ZB_CASES = {
    f"{model}-{mesh}-{sched}": (
        (ZB_LONG if sched == "seq1f1b-zb" else ZB_MODELS)[model],
        {**kw, "schedule": sched, **({"seq_chunks": 2} if sched == "seq1f1b-zb" else {})},
    )
    for model in ZB_MODELS
    for mesh, kw in ZB_MESHES.items()
    for sched in ("zb-h1", "seq1f1b-zb")
}
# with activation recomputation: the deferred GEMMs' inputs come from the rerun forward in B
ZB_CASES["nanogpt-pp2-zb-h1-recompute-full"] = (
    NANO_DEEP,
    {"pp": 2, "microbatches": 4, "schedule": "zb-h1", "recompute": "full"},
)
ZB_CASES["hf-gpt2-pp2-seq1f1b-zb-recompute-selective"] = (
    LONG["hf_gpt2"],
    {
        "pp": 2,
        "microbatches": 4,
        "schedule": "seq1f1b-zb",
        "seq_chunks": 2,
        "recompute": "selective",
    },
)
ZB_DEFAULT = ["hf-gpt2-tp2xpp2-seq1f1b-zb"]
