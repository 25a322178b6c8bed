"""Hugging Face causal LMs autopart was not written against (``autopart.models.zoo``, small random
configs): each plan is correct (float64 parity, float32 where the model has no float64 kernels,
at the tolerance of the precision the model computes in) or refused by ``parallelize`` naming
the construct; never wrong, never a crashed rank. A fast subset of the compatibility matrix runs
here and must match ``docs/compatibility.md`` row for row (``autopart zoo`` writes it).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

from autopart import AutopartError
from autopart.models import zoo
from autopart.parity.verify import Check, Report, verify_many

pytestmark = pytest.mark.multirank
DOCS = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"
# one architecture per fix: OPT's running-count positions and GPT-J's additive-mask float32
# attention (were silently wrong / crashed under Seq1F1B), Qwen3's per-head norms (wrong under
# tp), BLOOM's ALiBi (tp crashed; Seq1F1B refused), Mistral's sliding window (taken for causal
# attention, which is wrong beyond 4096 tokens; now chunked with its window)
SUBSET = ["qwen3"]
# -m slow (CI runs both): the whole matrix, every row against docs/compatibility.md (about 13
# minutes on 2 cores)
SLOW_SUBSET = list(zoo.ARCHITECTURES)
SEQ, BOTH = "pp=2 Seq1F1B k=2", "tp=2×pp=2 Seq1F1B k=2"


def assert_passes(result: Report | AutopartError, dtype: str = "float64") -> None:
    """PASS at the model's tolerance: float64's, or float32's for a model that runs in float32
    (``dtype``, the matrix's) or computes lower-precision islands."""
    if isinstance(result, AutopartError):
        raise result
    assert result.ok, str(result)
    lower = result.islands or dtype != "float64"
    assert result.tolerance == (1e-5 if lower else 1e-9), str(result)


@pytest.fixture(scope="module")
def matrix() -> dict[str, tuple[str, dict[str, Report | AutopartError]]]:
    """The default run's cross-section: Qwen3 under tp and tp×pp Seq1F1B (its whole row, like
    every other, is compared with the written matrix under -m slow)."""
    return zoo.matrix(SUBSET, {plan: zoo.PLANS[plan] for plan in ("tp=2", BOTH)})


@pytest.fixture(scope="module")
def slow_matrix() -> dict[str, tuple[str, dict[str, Report | AutopartError]]]:
    return zoo.matrix(SLOW_SUBSET)


@pytest.mark.slow
@pytest.mark.parametrize("arch", SLOW_SUBSET)
def test_more_rows_match_the_written_matrix(arch: str, slow_matrix) -> None:
    """As below, for every architecture of ``SLOW_SUBSET``."""
    written = zoo.parse_table(DOCS.read_text())
    fresh = zoo.parse_table(zoo.table({arch: slow_matrix[arch]}))
    assert fresh[arch] == written[arch]


@pytest.mark.parametrize("arch", SUBSET)
def test_rows_match_the_written_matrix(arch: str, matrix) -> None:
    """A fresh run of the architecture's cells equals its row in docs/compatibility.md: every
    verdict, every refusal's message, the dtype and the tolerance (here the default run's
    plans; the whole row under -m slow)."""
    written = zoo.parse_table(DOCS.read_text())[arch]
    fresh = zoo.parse_table(zoo.table({arch: matrix[arch]}))[arch]
    assert fresh == {k: v for k, v in written.items() if k in fresh}


def test_update_replaces_rows_and_redoes_the_counts() -> None:
    """``autopart zoo --update``: a checked row replaced, a new one appended, the refusals
    renumbered and the counts redone; the rest of the written table unchanged."""
    from types import SimpleNamespace

    written = DOCS.read_text()
    before = zoo.parse_table(written)
    ok = SimpleNamespace(ok=True, tolerance=1e-9, precision=None)
    refused = AutopartError("a new refusal", hint="")
    plans = list(next(iter(before.values())))[2:]
    fresh = {
        "gpt2": ("float64", {p: refused if p == plans[0] else ok for p in plans}),
        "newarch": ("float64", {p: ok for p in plans}),
    }
    after = zoo.parse_table(zoo.merge(written, fresh))
    assert after["gpt2"][plans[0]] == "refused: a new refusal"
    assert after["newarch"] == {
        "dtype": "float64",
        "tolerance": "1e-09",
        **dict.fromkeys(plans, "PASS"),
    }
    assert {k: v for k, v in after.items() if k not in fresh} == {
        k: v for k, v in before.items() if k not in fresh
    }
    words = [w for row in after.values() for k, w in row.items() if k in plans]
    summary = next(line for line in zoo.merge(written, fresh).splitlines() if "cells PASS" in line)
    assert f"**{words.count('PASS')} of {len(words)} cells PASS" in summary


def test_what_was_wrong_or_crashed_now_passes(matrix) -> None:
    for plan in ("tp=2", BOTH):
        assert_passes(matrix["qwen3"][1][plan])


@pytest.mark.slow
def test_what_was_wrong_or_crashed_now_passes_too(slow_matrix) -> None:
    for plan in (SEQ, BOTH):
        assert_passes(slow_matrix["opt"][1][plan])
    for plan in (SEQ, BOTH):
        assert_passes(slow_matrix["mistral"][1][plan])


@pytest.mark.slow
def test_gptj_and_bloom_pass_where_they_were_wrong_or_crashed(slow_matrix) -> None:
    for plan in (SEQ, BOTH):
        assert_passes(slow_matrix["gptj"][1][plan])
    assert_passes(slow_matrix["bloom"][1]["tp=2"])


@pytest.mark.slow
def test_scores_as_functions_of_positions_pass_seq1f1b(slow_matrix) -> None:
    """ALiBi (BLOOM, MPT), XGLM's folded clamp, soft-capping (Gemma 2, VaultGemma), GPT-1's −1e4
    mask, Doge's per-key bias and windows trimmed at k = 4 (Mistral): refused before
    passes/position_masks.py, exact now; and the plans the new rows crashed or failed in before
    their fixes."""
    for arch in ("bloom", "mpt", "gemma2", "vaultgemma", "openai-gpt", "doge"):  # GPT-1: −1e4
        for plan in (SEQ, BOTH, "pp=2 Seq1F1B k=4"):
            assert_passes(slow_matrix[arch][1][plan])
    for plan in (SEQ, BOTH, "pp=2 Seq1F1B k=4"):  # XGLM runs in float32: float32's tolerance
        assert_passes(slow_matrix["xglm"][1][plan], slow_matrix["xglm"][0])
    assert_passes(slow_matrix["mistral"][1]["pp=2 Seq1F1B k=4"])
    for arch in ("ernie4_5_moe", "nemotron_h", "mamba"):  # dp with a frozen parameter, ...
        for plan in ("dp=2", "tp=2", "pp=2 1F1B"):
            assert_passes(slow_matrix[arch][1][plan], slow_matrix[arch][0])


@pytest.mark.slow
def test_mamba2_scans_carry_their_state_under_seq1f1b(slow_matrix) -> None:
    """The six models with Mamba-2's SSD were refused at its padding to whole blocks; with the
    scan's state carried from chunk to chunk they pass every Seq1F1B plan (their scans run in
    float32: float32's tolerance)."""
    for arch in ("mamba2", "falcon_h1", "nemotron_h", "bamba", "granitemoehybrid", "zamba2"):
        for plan in (SEQ, BOTH, "pp=2 Seq1F1B k=4"):
            assert_passes(slow_matrix[arch][1][plan], slow_matrix[arch][0])


@pytest.mark.slow
def test_linear_attention_and_rolled_token_loops_pass_seq1f1b(slow_matrix) -> None:
    """MiniMax's lightning attention (no softmax: form 8) and the token loops of Mamba, Jamba and
    RecurrentGemma (rolled up at capture into autopart::linear_scan; RecurrentGemma's states
    written into a buffer, Jamba captured again at a length that is not its width) were refused
    before; every plan passes now. The refusals of a loop autopart does not roll up are
    tests/test_loops.py's negative controls."""
    for arch in ("minimax", "mamba", "jamba", "recurrent_gemma"):
        for plan in zoo.PLANS:
            assert_passes(slow_matrix[arch][1][plan], slow_matrix[arch][0])


@pytest.mark.slow  # suite time
def test_falcon_in_place_adds_are_functionalized(slow_matrix) -> None:
    """Falcon's forward adds in place: every plan failed to save before capture functionalized
    it; Seq1F1B also needed views of the prefixed attention to become reshapes."""
    for result in slow_matrix["falcon"][1].values():
        assert_passes(result)


@pytest.mark.slow  # suite time (tests/test_verify.py checks the islands on a small model)
def test_lower_precision_islands_set_the_tolerance_and_real_errors_still_fail() -> None:
    """Gemma 3 computes its norms in float32 inside a float64 model: verify says so and holds it
    to float32's tolerance (its float32 round-off, ~2e-7, is not a FAIL). The same model with a
    real error (the per-head norm gradients left unsummed over tp) still FAILs at that tolerance."""
    make = functools.partial(zoo.make, "gemma3_text")
    (ok,) = verify_many([Check(make, tp=2)], via="fork").values()
    assert ok.ok and ok.tolerance == 1e-5, str(ok)
    assert ok.islands and "model.layers.0.input_layernorm (float32)" in ok.islands
    assert "float32 inside the model: model.layers.0.input_layernorm" in str(ok)
    tp_pass = sys.modules["autopart.passes.tensor_parallel"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tp_pass, "sum_partial_grads", lambda *args: None)
        (bad,) = verify_many([Check(make, tp=2)], via="fork").values()
    assert not bad.ok and bad.grad_error > 0.1 and "_norm.weight" in bad.worst, str(bad)


@pytest.mark.slow  # suite time
def test_a_model_without_float64_kernels_is_verified_in_float32() -> None:
    """Mixtral's grouped expert matmuls have no float64 kernel: float64 verify says so and
    offers float32, where tp=2 and pp=2 Seq1F1B pass at its tolerance."""
    mixtral = "autopart.models.zoo:mixtral"
    checks = {"tp2": Check(mixtral, tp=2), "seq": Check(mixtral, **zoo.PLANS[SEQ])}
    (no64,) = verify_many({"x": checks["tp2"]}, via="fork").values()
    assert isinstance(no64, AutopartError)
    assert "does not run in float64 on one device" in no64.message, no64.message
    assert "--dtype float32, tolerance 1e-05" in no64.hint
    for name, result in verify_many(checks, dtype="float32", timeout_s=120, via="fork").items():
        assert not isinstance(result, AutopartError), (name, result)
        assert result.ok and result.tolerance == 1e-5, (name, str(result))


NEW = ["lfm2", "deepseek_v3", "minicpm3", "recurrent_gemma", "falcon_h1"]  # issue 37's review


def test_lfm2_convolution_chunks_exactly_under_seq1f1b() -> None:
    """LFM2's short causal depthwise conv1d along the sequence trained 34 % wrong under pp=2
    Seq1F1B k=2 (the deny-list knew no convolution), then was refused (the allow-list); now
    each chunk's convolution gets the previous chunk's last k − 1 inputs, carried like a K/V
    prefix: float64 parity under pp=2 Seq1F1B k=2, as docs/compatibility.md says (its
    tp=2×pp=2 cell, also PASS, runs in the slow test of the whole row below)."""
    dtype, cells = zoo.matrix(["lfm2"], {SEQ: zoo.PLANS[SEQ]})["lfm2"]
    assert dtype == "float64"
    assert_passes(cells[SEQ])
    written = zoo.parse_table(DOCS.read_text())["lfm2"]
    assert written[SEQ] == written[BOTH] == "PASS"


@pytest.mark.slow
@pytest.mark.parametrize("arch", NEW)
def test_new_architectures_pass_or_are_refused_before_launch(arch: str, slow_matrix) -> None:
    """Every cell of the five architectures the review found wrong or crashing: PASS, or a
    refusal by parallelize (never a FAIL or a crashed rank), as docs/compatibility.md says (the
    whole matrix's run of them: no second run)."""
    result = {arch: slow_matrix[arch]}
    for cell in result[arch][1].values():
        assert isinstance(cell, AutopartError) or cell.ok, str(cell)
    written = zoo.parse_table(DOCS.read_text())
    assert zoo.parse_table(zoo.table(result))[arch] == written[arch]


def test_check_names_every_cell_that_differs_from_the_written_matrix() -> None:
    """``autopart zoo --check``: a fresh row equal to the written one has no difference; a FAIL
    where the table says PASS, and another tolerance, are each named."""
    written = zoo.parse_table(DOCS.read_text())["gpt2"]
    plans = [p for p in zoo.PLANS if p in written]
    ok = Report(loss=1.0, ref_loss=1.0, loss_error=0.0, grad_error=0.0, worst="w", tolerance=1e-9)
    fresh = {"gpt2": ("float64", dict.fromkeys(plans, ok))}
    assert zoo.differences(DOCS.read_text(), fresh) == []
    bad = Report(loss=1.0, ref_loss=1.0, loss_error=0.0, grad_error=1.0, worst="w", tolerance=1e-9)
    fresh["gpt2"][1]["tp=2"] = bad
    assert zoo.differences(DOCS.read_text(), fresh) == ["gpt2 tp=2: written 'PASS', now 'FAIL'"]
    fresh["gpt2"][1]["tp=2"] = Report(1.0, 1.0, 0.0, 0.0, "w", 1e-5)
    (line,) = zoo.differences(DOCS.read_text(), fresh)
    assert line.startswith("gpt2 tolerance: written '1e-09'"), line


SP_NORMS = ["gemma", "gemma2", "nemotron", "cohere", "olmo", "phi", "gpt2", "mamba"]


@pytest.mark.slow
@pytest.mark.multirank
def test_sequence_parallelism_across_norm_styles() -> None:
    """tp=2 with sequence parallelism (not a column of the matrix: a sweep of every
    architecture, docs/compatibility.md) over one model of each way a norm reads its weight:
    Gemma's ``1 + w`` (whose gradients were 100 % off until the pass followed it), Nemotron's
    LayerNorm1P, Cohere's bias-free LayerNorm, OLMo's weightless one, Phi's, GPT-2's with
    learned positions; and Mamba, whose mixer reads a split hidden state's length (refused until
    the twenty-fourth session: it now reads the whole sequence's, tp × its rows)."""
    sp = {"tp=2 SP": {"tp": 2, "sequence_parallel": True}}
    rows = zoo.matrix(SP_NORMS, sp)
    assert sorted(rows) == sorted(SP_NORMS)
    for dtype, cells in rows.values():
        assert_passes(cells["tp=2 SP"], dtype)


SP_SEQ = ["mamba2", "granite_swa", "llama4_text", "minimax", "lfm2", "mamba"]


@pytest.mark.slow
@pytest.mark.multirank
def test_sequence_parallelism_with_seq1f1b_chunks() -> None:
    """tp=2 × pp=2 Seq1F1B k=2 with sequence parallelism (not a column of the matrix: a sweep
    of every architecture, docs/tensor_parallel.md) over one model of each construct that the
    combination used to refuse although each half passed: Mamba-2's block scan and LFM2's and
    Mamba's convolutions run whole on halves joined from the tp ranks (their sizes read
    2·(s//2), compared as strings with s), attention with sinks (kᵀ joined after its
    transpose), Llama 4's chunked attention (its rebuilt mask's key length read the ids, not
    the joined keys the chunk pass lengthens) and MiniMax's whole slice ``q[:, :, :s]`` of a
    split value."""
    plan = {**zoo.PLANS[BOTH], "sequence_parallel": True}
    rows = zoo.matrix(SP_SEQ, {"tp=2×pp=2 Seq1F1B k=2 SP": plan})
    assert sorted(rows) == sorted(SP_SEQ)
    for dtype, cells in rows.values():
        assert_passes(cells["tp=2×pp=2 Seq1F1B k=2 SP"], dtype)
