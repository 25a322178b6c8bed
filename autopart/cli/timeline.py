"""``autopart timeline``: draw a trace (``autopart run --trace``, ``autopart simulate --trace``)
as a PNG, one row per rank."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "timeline",
        help="draw a trace (autopart run --trace) as a timeline PNG",
        description="Draw a Chrome/Perfetto trace that autopart run --trace wrote as one row per "
        "rank of forward, backward and weight-gradient boxes, and print each rank's busy "
        "fraction (docs/timeline.md).",
    )
    t.add_argument("trace", metavar="TRACE", help="Chrome/Perfetto trace JSON")
    t.add_argument(
        "-o",
        "--out",
        default=None,
        metavar="PNG",
        help="picture to write (default: TRACE with .png)",
    )
    t.add_argument("--title", default="", help="title above the picture (default: TRACE as given)")


def main(a: argparse.Namespace) -> int:
    from pathlib import Path

    from autopart.runtime.timeline import busy_fractions, load_trace, plot_timeline

    events = load_trace(a.trace)
    out = plot_timeline(events, a.out or Path(a.trace).with_suffix(".png"), a.title or a.trace)
    for rank, frac in busy_fractions(events).items():
        print(f"rank {rank}: {frac:.1%} busy")
    print(f"wrote {out}")
    return 0
