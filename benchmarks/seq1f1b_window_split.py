"""Seq1F1B's balanced split under a sliding window: chunk boundaries from the window-aware cost
(every query of a windowed layer does at most W keys' work) against the causal-only cost autopart
used before (every query attends to its whole prefix) and a uniform cut.

Model: ``benchmarks/seq1f1b_window.py``'s Mistral-shaped model (4 blocks, width 256, 8 heads,
4 K/V heads, vocabulary 1024, float32, random weights, nothing downloaded) with a sliding window
of ``--window`` keys over one sequence of ``--seq`` tokens, compiled for one rank with
``schedule="seq1f1b"``. The stage graph runs chunk by chunk (forward and backward, the K/V
prefix trimmed to the window as autopart's runtime does) for each set of boundaries; each
chunk's time is the median of ``--repeats`` runs, after one unmeasured pass. Printed: the
boundaries, each chunk's milliseconds, the slowest over the fastest chunk (a pipeline waits for
its slowest chunk), the cost model's own max/min for those boundaries, and the window-aware
split's ratio against the causal-only one. The chunks' summed loss must equal the unchunked
model's, or it exits 1.

Measured (2-core CPU, torch 2.13, ``--seq 4096 --repeats 5``): window-aware [1032, 1024, 1024,
1016] 405 / 421 / 416 / 407 ms, slowest/fastest 1.04; causal-only (autopart's split before
windows were counted) [1632, 1000, 792, 672] 823 / 412 / 291 / 238 ms, 3.46; uniform 1.09;
window-aware / causal-only 0.30.

    python benchmarks/seq1f1b_window_split.py [--seq 4096] [--window 64] [--chunks 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from autopart.meta import META_KV

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, run as a script


def chunk_times(
    program: Any,
    ids: torch.Tensor,
    labels: torch.Tensor,
    bounds: list[tuple[int, int]],
    repeats: int,
) -> tuple[float, list[float]]:
    """The summed loss and each chunk's median forward + backward seconds (its prefix the one
    the chunk before handed on, as the runtime does)."""
    from seq1f1b_window import chunk_inputs

    from autopart.runtime.runner import local_weights

    rp = program.rank(0)
    (st,) = rp.stages
    gm = st.graph
    weights = local_weights(program, rp)
    params = {f: t.detach().requires_grad_() for f, t in weights.items() if f in rp.shards}
    n_kv = gm.meta[META_KV]
    shapes = gm.meta["autopart.kv_shapes"]
    prefix = [torch.zeros([1 if d == "b" else d for d in s]) for s in shapes]
    total, seconds = 0.0, []
    for a, e in bounds:
        args = chunk_inputs(st.inputs, params, weights, ids, labels, (a, e), prefix)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = gm(*args)
            out[0].backward()
            runs.append(time.perf_counter() - start)
        total += float(out[0].detach())
        seconds.append(statistics.median(runs))
        prefix = [t.detach() for t in out[-n_kv:]]
    return total, seconds


def measure(seq: int, window: int, chunks: int, repeats: int = 3) -> dict[str, Any]:
    """Each split's boundaries, chunk seconds and modelled work; the unchunked loss."""
    from seq1f1b_window import build

    import autopart
    from autopart.schedule.chunks import chunk_bounds, chunk_cost, windows_of

    model, ids, labels = build(seq, window)
    with torch.no_grad():
        want = float(
            F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten(), reduction="sum")
        )
    program = autopart.parallelize(
        model, autopart.Mesh(), (ids, labels), schedule="seq1f1b", seq_chunks=chunks
    )
    coeffs = program.rank(0).chunk_cost
    assert coeffs is not None and len(coeffs) > 2, coeffs  # the windows were found
    splits = {
        "window-aware": chunk_bounds(coeffs, seq, chunks),
        "causal-only": chunk_bounds(coeffs[:2], seq, chunks),
        "uniform": chunk_bounds(coeffs, seq, chunks, "uniform"),
    }
    out: dict[str, Any] = {"want": want, "coeffs": coeffs, "splits": {}}
    chunk_times(program, ids, labels, splits["uniform"], 1)  # warm-up, not measured
    for name, bounds in splits.items():
        loss, seconds = chunk_times(program, ids, labels, bounds, repeats)
        work = [chunk_cost(*coeffs[:2], a, e, windows_of(coeffs)) for a, e in bounds]
        out["splits"][name] = {"bounds": bounds, "loss": loss, "seconds": seconds, "work": work}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    r = measure(a.seq, a.window, a.chunks, a.repeats)
    c = r["coeffs"]
    print(
        f"Mistral-shaped, {a.seq} tokens, window {a.window}, k = {a.chunks}, float32, CPU: "
        f"c1 = {c[0]:.4g}, c2 = {c[1]:.4g}, windows {list(zip(c[2::2], c[3::2], strict=True))}"
    )
    ok, spread = True, {}
    for name, s in r["splits"].items():
        lengths = [e - b for b, e in s["bounds"]]
        ms = [f"{1e3 * t:.0f}" for t in s["seconds"]]
        spread[name] = max(s["seconds"]) / min(s["seconds"])
        model = max(s["work"]) / min(s["work"])
        print(
            f"{name:13s} chunks {lengths}: {' / '.join(ms)} ms per chunk (forward + backward), "
            f"slowest/fastest {spread[name]:.2f} (cost model {model:.2f})"
        )
        if abs(s["loss"] - r["want"]) > 1e-4 * abs(r["want"]):
            print(f"  loss {s['loss']:.6f} differs from the unchunked {r['want']:.6f}")
            ok = False
    print(
        "window-aware / causal-only slowest-over-fastest: "
        f"{spread['window-aware'] / spread['causal-only']:.2f}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
