"""The window benchmark on a small case: the trimmed and the full-prefix runs compute the
unchunked loss, and a chunk whose earlier tokens outnumber the window saves fewer bytes
trimmed."""

from __future__ import annotations

import pytest

from benchmarks.seq1f1b_window import measure


@pytest.mark.slow  # 26 s: an HF model compiled; the invariant is in tests/passes/ by default
def test_a_trimmed_prefix_saves_less_and_computes_the_same() -> None:
    m = measure(seq=64, window=8, chunks=4)
    assert abs(m["trimmed"] - m["want"]) <= 1e-5 * abs(m["want"])
    assert abs(m["trimmed"] - m["full"]) <= 1e-6 * abs(m["full"])
    first, *later = zip(m["rows_t"], m["rows_f"], strict=True)
    assert first[0]["saved"] == first[1]["saved"]  # no earlier tokens: nothing to trim
    for t, f in later:  # 16+ earlier tokens, a window of 8: at most 7 kept
        assert t["saved"] < f["saved"] and t["prefix"] < f["prefix"]
