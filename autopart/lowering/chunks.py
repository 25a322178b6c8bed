"""The Seq1F1B chunk lengths of a captured model: its cost coefficients, read off its graph.

``schedule/chunks.py`` balances chunks from the two coefficients ``(c1, c2)`` of the model's
forward FLOPs per sequence, ``c1·s + c2·s²``; this module reads them off a captured graph
(``cost_coefficients``) with the cost model of ``autopart.frontend.cost``, and gives a captured
model's chunk lengths (``sequence_chunks``, public as ``autopart.sequence_chunks``) and both
splits side by side (``chunk_table``, for ``autopart inspect``).

Attention is counted as the kernel that runs it. Under Seq1F1B every attention runs as the
canonical causal SDPA (``passes/canonicalize_attention.py``), whose kernels skip the masked
upper triangle; the captured graph may still hold it as an SDPA with an explicit mask (Hugging
Face models), which the cost convention counts as the full square. So the coefficients come from
a canonicalized copy of the graph (after ``fold_identities``, as the passes see it): for a 7B-shaped HF GPT-2 at 32k tokens, k = 4, that moves the
balanced chunks from [12568, 8128, 6496, 5576] (the full square) to [11064, 8416, 7072, 6216].
"""

from __future__ import annotations

import math
from dataclasses import replace

import sympy

from autopart.errors import AutopartError
from autopart.frontend.capture import B, Captured, S
from autopart.frontend.cost import analyze, node_cost, total
from autopart.layout import Mesh, Plan
from autopart.meta import META_WINDOW
from autopart.passes.canonicalize_attention import canonicalize_attention
from autopart.passes.einsum_products import einsum_products
from autopart.passes.fold_identities import fold_identities
from autopart.passes.seq_rules import moduli
from autopart.schedule.chunks import SPLITS, chunk_cost, chunk_lengths, windows_of


def cost_coefficients(captured: Captured) -> tuple[float, ...]:
    """(c1, c2, W1, f1, …): the model's forward FLOPs per sequence are c1·s + c2·s² (+ constants),
    attention counted as the canonical causal kernel Seq1F1B runs (see the module docstring);
    f_i is the share of c2 computed by attention with a sliding window of W_i keys (none
    without windows), which ``autopart.schedule.chunks`` counts as W_i keys per query."""
    limit = captured.seq_limit[0] if captured.seq_limit is not None else None
    plan = Plan(Mesh(), schedule="seq1f1b", max_seq=limit)
    gm = fold_identities(captured.for_passes(), plan)
    gm = canonicalize_attention(einsum_products(gm, plan), plan)
    flops = sympy.expand(
        total(g.cost for g in analyze(replace(captured, graph=gm))).flops.subs(B, 1)
    )
    c1, c2 = _quadratic(flops)
    shares: dict[int, float] = {}
    for n in gm.graph.nodes:
        window = n.meta.get(META_WINDOW)
        if n.op == "call_function" and isinstance(window, int) and window > 0 and c2 > 0:
            own = sympy.expand(node_cost(n, gm).flops.subs(B, 1))
            shares[window] = shares.get(window, 0.0) + float(
                sympy.Poly(own, S).coeff_monomial(S**2) / c2
            )
    return (c1, c2, *(v for w in sorted(shares) for v in (float(w), min(shares[w], 1.0))))


def _quadratic(flops: sympy.Expr) -> tuple[float, float]:
    """(c1, c2) of FLOPs c0 + c1·s + c2·s². A scan's padding to whole blocks of Q tokens writes
    sizes with ``Mod`` and floor division of s; chunks are multiples of Q, so such FLOPs are
    read at multiples of Q (exactly, through three lengths, checked at two more)."""
    try:
        poly = sympy.Poly(flops, S)
    except sympy.PolynomialError:
        poly = None
    if poly is not None:
        if poly.degree() > 2:
            raise AutopartError(f"the cost model is not quadratic in the sequence length: {flops}")
        return float(poly.coeff_monomial(S)), float(poly.coeff_monomial(S**2))
    q = math.lcm(1, *moduli(flops))
    xs = [q * m * 64 for m in (1, 2, 3, 5, 8)]
    ys = [sympy.nsimplify(flops.xreplace({S: x})) for x in xs]
    t = sympy.Symbol("t")
    fit = sympy.expand(sympy.interpolate(list(zip(xs[:3], ys[:3], strict=True)), t))
    if any(fit.subs(t, x) != y for x, y in zip(xs[3:], ys[3:], strict=True)):
        raise AutopartError(f"the cost model is not quadratic in the sequence length: {flops}")
    return float(fit.coeff(t, 1)), float(fit.coeff(t, 2))


def sequence_chunks(
    captured: Captured, seq_len: int, k: int, split: str = "balanced", multiple: int = 8
) -> list[int]:
    """Lengths of the k chunks of a ``seq_len``-token sequence, in order (they sum to seq_len)."""
    coeffs = cost_coefficients(captured) if split != "uniform" else (1.0, 0.0)
    return chunk_lengths(coeffs, seq_len, k, split, multiple)


def chunk_table(captured: Captured, seq_len: int, k: int, multiple: int = 8) -> list[dict]:
    """Both splits with each chunk's forward FLOPs and the max/min ratio (for inspect)."""
    coeffs = cost_coefficients(captured)
    c1, c2, windows = coeffs[0], coeffs[1], windows_of(coeffs)
    rows = []
    for split in SPLITS:
        lengths = sequence_chunks(captured, seq_len, k, split, multiple)
        edges = [0, *[sum(lengths[: j + 1]) for j in range(k)]]
        costs = [chunk_cost(c1, c2, a, e, windows) for a, e in zip(edges, edges[1:], strict=False)]
        rows.append(
            {
                "split": split,
                "lengths": lengths,
                "costs": costs,
                "max_over_min": max(costs) / min(costs),
            }
        )
    return rows


__all__ = ["chunk_table", "cost_coefficients", "sequence_chunks"]
