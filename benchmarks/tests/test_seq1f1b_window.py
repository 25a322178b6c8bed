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


@pytest.mark.slow  # an HF model compiled and run three times over
def test_the_window_aware_split_is_found_and_every_split_computes_the_same() -> None:
    """The split benchmark at 256 tokens (a window of 8): the program's chunk cost carries the
    window, its balanced chunks are nearly equal while the causal-only ones shrink, and every
    split's chunks sum to the unchunked loss."""
    from benchmarks.seq1f1b_window_split import measure as split

    m = split(seq=256, window=8, chunks=4, repeats=1)
    assert m["coeffs"][2] == 8.0
    lengths = {n: [e - a for a, e in s["bounds"]] for n, s in m["splits"].items()}
    assert lengths["window-aware"] == [64, 64, 64, 64] != lengths["causal-only"]
    assert lengths["causal-only"] == sorted(lengths["causal-only"], reverse=True)
    for s in m["splits"].values():
        assert abs(s["loss"] - m["want"]) <= 1e-5 * abs(m["want"])
