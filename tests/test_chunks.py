"""Seq1F1B chunk boundaries: balanced by the symbolic cost, rounded, refused when impossible."""

from __future__ import annotations

import gpt7b
import pytest
from conftest import Case

import autopart
from autopart.errors import AutopartError
from autopart.frontend.capture import capture
from autopart.lowering import chunks
from autopart.schedule.chunks import attention_work, chunk_cost, chunk_lengths, fit_coefficients


@pytest.fixture(scope="module")
def seven_b():
    model, batch = gpt7b.make()
    return capture(model, batch)


@pytest.mark.slow  # suite time: capturing the 7B shape on meta
def test_seven_b_at_32k_tokens_balanced_vs_uniform(seven_b) -> None:
    rows = {r["split"]: r for r in chunks.chunk_table(seven_b, 32768, 4)}
    assert rows["balanced"]["max_over_min"] <= 1.02  # target: within 2 %
    assert rows["uniform"]["max_over_min"] > 1.30  # later chunks attend to more: > 30 % apart
    lengths = rows["balanced"]["lengths"]
    assert sum(lengths) == 32768 and all(n % 8 == 0 for n in lengths)
    assert lengths == sorted(lengths, reverse=True)  # later chunks are shorter


def test_public_function_and_uniform(gpt_sdpa: Case) -> None:
    assert autopart.sequence_chunks(gpt_sdpa.captured, 64, 4, split="uniform") == [16, 16, 16, 16]
    balanced = autopart.sequence_chunks(gpt_sdpa.captured, 64, 2)
    assert sum(balanced) == 64 and balanced[0] >= balanced[1]
    assert chunks.sequence_chunks(gpt_sdpa.captured, 48, 2, multiple=24) == [24, 24]


def test_cost_form_matches_the_model(gpt_sdpa: Case) -> None:
    c1, c2 = chunks.cost_coefficients(gpt_sdpa.captured)
    assert c1 > 0 and c2 > 0
    whole = chunk_cost(c1, c2, 0, 64)
    parts = chunk_cost(c1, c2, 0, 40) + chunk_cost(c1, c2, 40, 64)
    assert parts == pytest.approx(whole)  # chunk costs add up to the sequence's


def test_refusals(gpt_sdpa: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AutopartError) as err:
        autopart.sequence_chunks(gpt_sdpa.captured, 32, 8)  # 8 chunks need ≥ 64 tokens
    assert "cannot be cut into 8 chunks" in err.value.message and "at most 4" in err.value.hint
    with pytest.raises(AutopartError, match="unknown sequence split"):
        autopart.sequence_chunks(gpt_sdpa.captured, 64, 2, split="even")
    monkeypatch.setattr(chunks, "cost_coefficients", lambda captured: (1.0, 1000.0))
    with pytest.raises(AutopartError) as err:  # attention-bound: boundaries ~14 and ~20 → 16, 16
        chunks.sequence_chunks(gpt_sdpa.captured, 24, 3)
    assert "leaves an empty chunk" in err.value.message and "fewer chunks" in err.value.hint


def test_attention_counted_as_the_causal_kernel() -> None:
    """HF GPT-2 holds its attention as an SDPA with an explicit mask, nanoGPT as
    ``is_causal=True``; Seq1F1B runs both as the causal kernel, so the same shapes give the same
    attention coefficient (the full square would be twice as much)."""
    import hf_gpt2
    import nanogpt
    import sympy

    from autopart.frontend.capture import B, S
    from autopart.frontend.cost import analyze, total

    captured = capture(*hf_gpt2.make())
    hf = chunks.cost_coefficients(captured)
    nano = chunks.cost_coefficients(capture(*nanogpt.make()))
    assert hf[1] == pytest.approx(nano[1], rel=0.01)
    as_captured = sympy.expand(total(g.cost for g in analyze(captured)).flops.subs(B, 1))
    assert float(sympy.Poly(as_captured, S).coeff_monomial(S**2)) > 1.9 * hf[1]


def test_fit_coefficients_recovers_a_cost_and_refuses_too_little() -> None:
    c1, c2 = 3.0, 0.01
    samples = [(a, e, chunk_cost(c1, c2, a, e)) for a, e in [(0, 96), (96, 160), (160, 256)]]
    got = fit_coefficients(samples)
    assert got == pytest.approx((c1, c2), rel=1e-9)
    assert fit_coefficients(samples[:1]) is None  # one chunk cannot separate two terms
    # a later chunk timed faster than an earlier, equally long one (noise): no negative cost
    c1_only = fit_coefficients([(0, 128, 10.0), (128, 256, 9.0)])
    assert c1_only is not None and c1_only[1] == 0.0 and c1_only[0] > 0


def test_windowed_attention_costs_its_window_per_query() -> None:
    """A layer with a sliding window of W keys does W keys' work per query past W: its part of
    the attention term grows linearly there (continuous at W), chunk costs still add up, and
    the balanced split of a model whose attention is all windowed (W ≪ s) is nearly uniform,
    while W ≥ s is the causal split; measured times fit with the windows kept."""
    windows = ((64.0, 1.0),)
    assert attention_work(64, windows) == 64 * 64
    assert attention_work(65, windows) - attention_work(64, windows) == 128  # 2W per query
    assert attention_work(100, ((1e6, 0.5),)) == 100 * 100  # a window longer than the sequence
    c1, c2 = 50.0, 1.0
    whole = chunk_cost(c1, c2, 0, 4096, windows)
    parts = chunk_cost(c1, c2, 0, 1000, windows) + chunk_cost(c1, c2, 1000, 4096, windows)
    assert parts == pytest.approx(whole)
    causal = chunk_lengths((c1, c2), 4096, 4)
    windowed = chunk_lengths((c1, c2, *windows[0]), 4096, 4)
    assert causal == [2032, 856, 656, 552] and windowed == [1040, 1016, 1024, 1016]
    for lengths, spread in ((causal, 3.5), (windowed, 1.01)):  # the work each chunk really does
        ends = [sum(lengths[: j + 1]) for j in range(4)]
        work = [chunk_cost(c1, c2, a, e, windows) for a, e in zip([0, *ends], ends, strict=False)]
        assert (max(work) / min(work) > spread) == (spread > 2), (lengths, work)
    assert chunk_lengths((c1, c2, 8192.0, 1.0), 4096, 4) == causal
    half = chunk_lengths((c1, c2, 64.0, 0.5), 4096, 4)  # half the layers windowed: between
    assert causal[0] > half[0] > windowed[0]
    samples = [(a, e, chunk_cost(3.0, 0.01, a, e, windows)) for a, e in [(0, 96), (96, 256)]]
    assert fit_coefficients(samples, windows) == pytest.approx((3.0, 0.01, 64.0, 1.0))


def test_cost_coefficients_find_the_windows() -> None:
    """Mistral's layers (a window of 8 keys in the zoo's config) give their share of c2 with
    W = 8; Llama's none; at 256 tokens in 4 chunks Mistral's balanced split is uniform."""
    from autopart.models import zoo

    mistral = capture(*zoo.make("mistral"))
    coeffs = chunks.cost_coefficients(mistral)
    assert coeffs[2] == 8.0 and 0.9 < coeffs[3] <= 1.0 and len(coeffs) == 4
    assert len(chunks.cost_coefficients(capture(*zoo.make("llama")))) == 2
    assert chunks.sequence_chunks(mistral, 256, 4) == [64, 64, 64, 64]
