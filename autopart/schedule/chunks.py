"""Computation-balanced sequence chunks for Seq1F1B: the arithmetic of the boundaries.

Chunk j of a sequence (tokens ``[a, e)``) attends to every earlier token of the same sequence,
so under the causal convention of ``autopart.frontend.cost`` its forward work is

    C(a, e) = c1 · (e − a) + c2 · (e² − a²)

where ``c1·s + c2·s²`` is the model's forward FLOPs per sequence (b = 1) in the sequence length
``s`` (``c1``: per-token work — projections, MLP, norms, LM head; ``c2``: attention, whose s²
term telescopes exactly over chunks). Backward is 2× the forward for every term, so balancing
the forward balances forward + backward. The coefficients of a captured model come from
``autopart/lowering/chunks.py`` (``cost_coefficients``, read off its graph); this module only
needs the two numbers, so the runtime, the dry run and the simulator use it without a model.

**Sliding windows.** A layer whose queries see at most the last W keys does W keys' work per
query past the first W tokens, not t's: its share f of the attention term grows like

    A_W(x) = x²  (x ≤ W),   W² + 2·W·(x − W)  (x > W)

in place of x² (the same convention: A_W(e) − A_W(a) is twice the query-key pairs of the chunk
[a, e)). The coefficients then travel as ``(c1, c2, W1, f1, W2, f2, …)``: f_i is the share of
c2 computed by layers of window W_i (the rest is causal over the whole prefix), and

    C(a, e) = c1 · (e − a) + c2 · (A(e) − A(a)),   A = (1 − Σ f_i)·x² + Σ f_i·A_{W_i}(x).

A model of windowed layers only (Mistral at s ≫ W) is then nearly linear, and its balanced
chunks nearly equal, where the quadratic alone would shorten the later chunks for work they do
not do.

``balanced`` solves C(e_{j−1}, e_j) = C(0, s)/k for each boundary in turn (C increases with e:
bisection), then rounds boundaries to a multiple of ``multiple`` (8, or lcm(8, tp)
under sequence parallelism). ``uniform`` cuts equal lengths. ``measured`` balances like
``balanced`` with coefficients the runtime fits to the chunk times it measures
(``fit_coefficients``; until it has them, the FLOP coefficients): FLOPs are not time on a
machine whose attention kernel runs at another speed than its matmuls. All return lengths.

``layout`` checks a plan's ``seq_split`` against ``SPLITS`` here, so this module imports no
torch until a function needs one (``fit_coefficients``): making a ``Plan``, and the simulator,
import no torch.
"""

from __future__ import annotations

from autopart.errors import AutopartError

SPLITS = ("balanced", "uniform", "measured")


Windows = tuple[tuple[float, float], ...]  # (W, share of c2) per window size


def fewer_chunks(most: int) -> str:
    """The hint for a sequence too short for its chunks: ``most`` chunks fit."""
    if most >= 2:
        return f"use at most {most} chunks"
    return "use seq_chunks=1 (no sequence chunks: 1F1B's order) or another schedule"


def windows_of(coeffs: tuple[float, ...]) -> Windows:
    """The ``(W, f)`` pairs after ``(c1, c2)`` in a coefficient tuple."""
    rest = coeffs[2:]
    return tuple((rest[i], rest[i + 1]) for i in range(0, len(rest) - 1, 2))


def attention_work(x: float, windows: Windows = ()) -> float:
    """A(x): the attention term's growth with the prefix length x (x² when nothing is
    windowed; see the module docstring)."""
    causal = 1.0 - sum(f for _, f in windows)
    windowed = sum(f * (x * x if x <= w else w * w + 2 * w * (x - w)) for w, f in windows)
    return causal * x * x + windowed


def chunk_cost(c1: float, c2: float, a: int, e: int, windows: Windows = ()) -> float:
    """Forward FLOPs of the chunk of tokens [a, e) with its causal prefix (b = 1)."""
    return c1 * (e - a) + c2 * (attention_work(e, windows) - attention_work(a, windows))


def fit_coefficients(
    samples: list[tuple[int, int, float]], windows: Windows = ()
) -> tuple[float, ...] | None:
    """(c1, c2, *windows) with t ≈ c1·(e − a) + c2·(A(e) − A(a)) over measured chunks
    ``(a, e, t)`` (least squares; k = 2 chunks solve it exactly; the windows' shares are the
    graph's, kept). A chunk's fixed cost (launches, the interpreter) is the same for every
    chunk, so it does not move the balance, and the linear term absorbs it near the boundaries
    measured. A negative coefficient (noise) becomes 0; None when the samples cannot say (fewer
    than 2 distinct chunks, or both coefficients ≤ 0)."""
    import torch

    rows = {(a, e): t for a, e, t in samples}
    if len(rows) < 2:
        return None
    x = torch.tensor(
        [[e - a, attention_work(e, windows) - attention_work(a, windows)] for a, e in rows],
        dtype=torch.float64,
    )
    t = torch.tensor(list(rows.values()), dtype=torch.float64)
    scale = x.abs().amax(0).clamp(min=1)  # columns of similar size for the solver
    c = torch.linalg.lstsq(x / scale, t[:, None]).solution[:, 0] / scale
    c1, c2 = (max(float(v), 0.0) for v in c)
    flat = tuple(v for pair in windows for v in pair)
    return (c1, c2, *flat) if c1 > 0 or c2 > 0 else None


def chunk_lengths(
    coeffs: tuple[float, ...], seq_len: int, k: int, split: str = "balanced", multiple: int = 8
) -> list[int]:
    """``sequence_chunks`` from the cost coefficients ``(c1, c2, *windows)`` (what the runtime
    keeps)."""
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
            hint=fewer_chunks(seq_len // multiple) + ", or a longer sequence",
        )
    bounds: list[float]
    if split == "uniform":
        bounds = [round(seq_len * j / k) for j in range(k + 1)]
    else:
        bounds = _balanced(coeffs, seq_len, k)
    lengths = _round(bounds, seq_len, multiple)
    if any(n <= 0 for n in lengths):
        raise AutopartError(
            f"rounding the chunk boundaries {[round(b) for b in bounds]} to multiples of {multiple} "
            "leaves an empty chunk",
            hint="use fewer chunks or a longer sequence",
        )
    return lengths


def chunk_bounds(
    coeffs: tuple[float, ...], seq_len: int, k: int, split: str = "balanced", multiple: int = 8
) -> list[tuple[int, int]]:
    """``chunk_lengths`` as the [start, end) token range of each chunk."""
    lengths = chunk_lengths(coeffs, seq_len, k, split, multiple)
    ends = [sum(lengths[: j + 1]) for j in range(len(lengths))]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _balanced(coeffs: tuple[float, ...], seq_len: int, k: int) -> list[float]:
    c1, c2, windows = coeffs[0], coeffs[1], windows_of(coeffs)

    def cost(a: float, e: float) -> float:
        return c1 * (e - a) + c2 * (attention_work(e, windows) - attention_work(a, windows))

    target = cost(0, seq_len) / k
    bounds = [0.0]
    for _ in range(k - 1):
        a, lo, hi = bounds[-1], bounds[-1], float(seq_len)
        if cost(a, hi) <= target:
            bounds.append(hi)
            continue
        for _ in range(100):  # C(a, ·) increases: bisection to float precision
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if cost(a, mid) < target else (lo, mid)
        bounds.append(hi)
    return [*bounds, float(seq_len)]


def _round(bounds: list[float], seq_len: int, multiple: int) -> list[int]:
    inner = [int(multiple * round(b / multiple)) for b in bounds[1:-1]]
    edges = [0, *inner, seq_len]
    return [b - a for a, b in zip(edges, edges[1:], strict=False)]


__all__ = [
    "SPLITS",
    "attention_work",
    "chunk_bounds",
    "chunk_cost",
    "chunk_lengths",
    "fit_coefficients",
    "windows_of",
]
