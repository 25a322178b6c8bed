"""The simulator against published Megatron-LM runs: predicted beside published for every row of
``autopart/planning/published.py`` (Korthikanti et al. 2022, Tables 3 and 5: fitted on;
Narayanan et al. 2021, Tables 1 and 2: checked only), the per-layer times of Korthikanti et al.
Table 4 (checked only), and a refit of the A100 preset's two efficiencies on the fitted rows.
Exits 1 if the worst error is above 10 % or the mean above 5 %.

    python benchmarks/published.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import record  # noqa: E402

# Korthikanti et al. 2022, Table 4: one 22B layer (tp=8, micro-batch 4, 2048 tokens), ms
TABLE_4 = {
    ("none", False): (7.7, 11.9),
    ("none", True): (7.2, 11.8),
    ("full", False): (7.7, 19.5),
    ("selective", False): (7.7, 13.2),
    ("selective", True): (7.2, 13.1),
}


def main() -> int:
    from autopart.planning import published as P
    from autopart.planning.cluster import preset
    from autopart.planning.simulate.performance import _layer

    res = P.compare()
    print(f"{'source':<20}{'row':<24}{'metric':<16}{'published':>10}{'predicted':>10}{'error':>8}")
    for r in res:
        src = ("fit: " if r["role"] == "fit" else "check: ") + r["source"].split()[0]
        print(
            f"{src:<20}{r['label']:<24}{r['metric']:<16}{r['published']:>10.2f}"
            f"{r['predicted']:>10.2f}{r['error']:>+8.1%}"
        )
    for role in ("fit", "check", None):
        mean, worst = P.errors(res, role)
        print(f"{role or 'all'} rows: mean |error| {mean:.1%}, worst {worst:.1%}")
    mean, worst = P.errors(res)
    record("published", "mean |error| over published runs", 100 * mean, 5.0, "goal", unit="%")
    record("published", "worst |error| over published runs", 100 * worst, 10.0, "goal", unit="%")

    cl = P.software("megatron-2022")
    shape = P.ROWS[-1].shape.__class__(48, 6144, 64, 51200, 2048)
    print("\nKorthikanti et al. Table 4, one 22B layer (checked only), ms:")
    for (rc, sp), (f, b) in TABLE_4.items():
        u = _layer(shape, cl, 8, sp, rc, "unfused", 4, 0, 2048)
        pf, pb = 1e3 * (u.f + u.f_tp), 1e3 * (u.b + u.b_tp)
        print(
            f"  {rc:<10}{'SP' if sp else '  '}  forward {pf:6.2f} vs {f:5.1f} ({pf / f - 1:+.1%})"
            f"   backward {pb:6.2f} vs {b:5.1f} ({pb / b - 1:+.1%})"
        )

    fitted = P.fit()
    base = preset("dgx-a100-80gb")
    print(
        "\nrefit on the fit rows: "
        + ", ".join(f"{k} {v:.3f} (preset {getattr(base, k)})" for k, v in fitted.items())
    )
    return 0 if mean <= 0.05 and worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
