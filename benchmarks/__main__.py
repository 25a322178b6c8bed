"""``python -m benchmarks``: run every peer comparison and print one table of ratios.

Each benchmark runs as it does alone (``python benchmarks/NAME.py``: its own torchrun ranks and
full printout), then the rows it recorded are gathered into one table: what was measured,
autopart's figure, the peer's (named in the row), their ratio and whether the goal was met.
``--only NAME ...`` runs a subset. Exit status 1 if any goal was missed or a benchmark failed.
``python -m benchmarks gpu`` is the one-GPU run instead (``benchmarks/gpu.py``: the GPU checks,
then autopart against ``torch.compile`` and eager on a 1B Llama).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _launch  # noqa: E402

# name → how its main() is called (the scripts keep their own command lines for single runs)
BENCHMARKS = {
    "capture_1t": lambda mod: mod.main(),
    "collectives": lambda mod: mod.main(),
    "tp_vs_dtensor": lambda mod: mod.main(),
    "pipeline_bubble": lambda mod: mod.main(),
    "pp_vs_pipelining": lambda mod: mod.main(False),
    "compile_cache": lambda mod: mod.main(),
    "plan_1t": lambda mod: mod.main(),
    "calibration": lambda mod: mod.main(),
    "closed_loop": lambda mod: mod.main([]),
    "recompute": lambda mod: mod.main(),
    "precision": lambda mod: mod.main(),
    "published": lambda mod: mod.main(),
    "seq1f1b": lambda mod: mod.main(argparse.Namespace(seq=1024, microbatches=8, manual=False)),
    "seq1f1b_ssm": lambda mod: mod.main(argparse.Namespace(seq=1024, block=64)),
    "zero_bubble": lambda mod: mod.main(argparse.Namespace(seq=512, microbatches=8, width=256)),
}


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    if sys.argv[1:2] == ["gpu"]:  # the one-GPU check and throughput run (benchmarks/gpu.py)
        return importlib.import_module("gpu").main(sys.argv[2:])
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.splitlines()[0],
        epilog="python -m benchmarks gpu [--help]: the one-GPU checks and throughput run",
    )
    ap.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run only these")
    args = ap.parse_args()
    con = Console()
    if not con.is_terminal:  # a log file: room for the table
        con = Console(width=150)
    failed, start = [], time.perf_counter()
    for name in args.only or BENCHMARKS:
        con.rule(f"[bold]{name}")
        t = time.perf_counter()
        try:
            code = BENCHMARKS[name](importlib.import_module(name))
        except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the others
            con.print(f"[red]{name} failed: {type(exc).__name__}: {exc}")
            code = 2
        if code:
            failed.append(name)
        con.print(f"({name}: {time.perf_counter() - t:.0f} s, exit {code})")
    table = Table(title=f"autopart against its peers ({time.perf_counter() - start:.0f} s)")
    for col in ("benchmark", "measured", "autopart", "peer", "peer figure", "ratio", "goal", "met"):
        table.add_column(
            col, justify="right" if col in ("autopart", "peer figure", "ratio") else "left"
        )
    for r in _launch.ROWS:
        met = "" if r["met"] is None else ("yes" if r["met"] else "[red]NO")
        table.add_row(
            r["benchmark"],
            r["metric"],
            f"{r['autopart']:.4g} {r['unit']}",
            r["peer_name"],
            f"{r['peer']:.4g} {r['unit']}",
            f"{r['ratio']:.3f}",
            r["goal"],
            met,
        )
    con.print(table)
    if failed:
        con.print(f"[red]failed: {', '.join(failed)}")
    missed = [r for r in _launch.ROWS if r["met"] is False]
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
