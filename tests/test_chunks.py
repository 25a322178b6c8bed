"""Seq1F1B chunk boundaries: balanced by the symbolic cost, rounded, refused when impossible."""

from __future__ import annotations

import gpt7b
import pytest
from conftest import Case

import autopart
from autopart.errors import AutopartError
from autopart.frontend.capture import capture
from autopart.schedule import chunks


@pytest.fixture(scope="module")
def seven_b():
    model, batch = gpt7b.make()
    return capture(model, batch)


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
    whole = chunks.chunk_cost(c1, c2, 0, 64)
    parts = chunks.chunk_cost(c1, c2, 0, 40) + chunks.chunk_cost(c1, c2, 40, 64)
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
