"""Computation-balanced sequence chunks for Seq1F1B.

Chunk j of a sequence (tokens ``[a, e)``) attends to every earlier token of the same sequence,
so under the causal convention of ``autopart.frontend.cost`` its forward work is

    C(a, e) = c1 · (e − a) + c2 · (e² − a²)

where ``c1·s + c2·s²`` is the captured model's forward FLOPs per sequence (b = 1) as a sympy
polynomial in the sequence length ``s`` (``c1``: per-token work — projections, MLP, norms,
LM head; ``c2``: attention, whose s² term telescopes exactly over chunks). Backward is 2× the
forward for every term, so balancing the forward balances forward + backward.

``balanced`` solves C(e_{j−1}, e_j) = C(0, s)/k for each boundary in turn (a quadratic in e_j,
solved with sympy), then rounds boundaries to a multiple of ``multiple`` (8, or lcm(8, tp)
under sequence parallelism). ``uniform`` cuts equal lengths. Both return chunk lengths.
"""

from __future__ import annotations

import sympy

from autopart.errors import AutopartError
from autopart.frontend.capture import B, Captured, S
from autopart.frontend.cost import analyze, total

SPLITS = ("balanced", "uniform")


def cost_coefficients(captured: Captured) -> tuple[float, float]:
    """(c1, c2): the model's forward FLOPs per sequence are c1·s + c2·s² (+ constants)."""
    flops = sympy.expand(total(g.cost for g in analyze(captured)).flops.subs(B, 1))
    poly = sympy.Poly(flops, S)
    if poly.degree() > 2:
        raise AutopartError(f"the cost model is not quadratic in the sequence length: {flops}")
    return float(poly.coeff_monomial(S)), float(poly.coeff_monomial(S**2))


def chunk_cost(c1: float, c2: float, a: int, e: int) -> float:
    """Forward FLOPs of the chunk of tokens [a, e) with its causal prefix (b = 1)."""
    return c1 * (e - a) + c2 * (e * e - a * a)


def sequence_chunks(
    captured: Captured, seq_len: int, k: int, split: str = "balanced", multiple: int = 8
) -> list[int]:
    """Lengths of the k chunks of a ``seq_len``-token sequence, in order (they sum to seq_len)."""
    coeffs = cost_coefficients(captured) if split == "balanced" else (1.0, 0.0)
    return chunk_lengths(coeffs, seq_len, k, split, multiple)


def chunk_lengths(
    coeffs: tuple[float, float], seq_len: int, k: int, split: str = "balanced", multiple: int = 8
) -> list[int]:
    """``sequence_chunks`` from the cost coefficients ``(c1, c2)`` (what the runtime keeps)."""
    if split not in SPLITS:
        raise AutopartError(
            f"unknown sequence split {split!r}", hint=f"use one of {', '.join(SPLITS)}"
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise AutopartError(f"seq_chunks={k!r} must be a positive integer")
    if k == 1:
        return [seq_len]
    if seq_len < k * multiple:
        raise AutopartError(
            f"a sequence of {seq_len} tokens cannot be cut into {k} chunks of at least {multiple}",
            hint=f"use at most {max(1, seq_len // multiple)} chunks, or a longer sequence",
        )
    if split == "uniform":
        bounds = [round(seq_len * j / k) for j in range(k + 1)]
    else:
        bounds = _balanced(*coeffs, seq_len, k)
    lengths = _round(bounds, seq_len, multiple)
    if any(n <= 0 for n in lengths):
        raise AutopartError(
            f"rounding the chunk boundaries {[round(b) for b in bounds]} to multiples of {multiple} "
            "leaves an empty chunk",
            hint="use fewer chunks or a longer sequence",
        )
    return lengths


def _balanced(c1: float, c2: float, seq_len: int, k: int) -> list[float]:
    target = chunk_cost(c1, c2, 0, seq_len) / k
    e = sympy.Symbol("e", positive=True)
    bounds = [0.0]
    for _ in range(k - 1):
        a = bounds[-1]
        roots = sympy.solve(sympy.Eq(c1 * (e - a) + c2 * (e**2 - a**2), target), e)
        real = [float(r) for r in roots if r.is_real and float(r) > a]
        bounds.append(min(real) if real else float(seq_len))
    return [*bounds, float(seq_len)]


def _round(bounds: list[float], seq_len: int, multiple: int) -> list[int]:
    inner = [int(multiple * round(b / multiple)) for b in bounds[1:-1]]
    edges = [0, *inner, seq_len]
    return [b - a for a, b in zip(edges, edges[1:], strict=False)]


def chunk_table(captured: Captured, seq_len: int, k: int, multiple: int = 8) -> list[dict]:
    """Both splits with each chunk's forward FLOPs and the max/min ratio (for inspect)."""
    c1, c2 = cost_coefficients(captured)
    rows = []
    for split in SPLITS:
        lengths = sequence_chunks(captured, seq_len, k, split, multiple)
        edges = [0, *[sum(lengths[: j + 1]) for j in range(k)]]
        costs = [chunk_cost(c1, c2, a, e) for a, e in zip(edges, edges[1:], strict=False)]
        rows.append(
            {
                "split": split,
                "lengths": lengths,
                "costs": costs,
                "max_over_min": max(costs) / min(costs),
            }
        )
    return rows


__all__ = ["chunk_cost", "chunk_lengths", "chunk_table", "cost_coefficients", "sequence_chunks"]
