"""``autopart zoo``: verify the Hugging Face architectures of ``autopart.models.zoo`` under the
standard plans and write the compatibility matrix."""

from __future__ import annotations

import argparse

from autopart.errors import AutopartError, positive_seconds


def add_parser(sub: argparse._SubParsersAction) -> None:
    z = sub.add_parser(
        "zoo",
        help="verify Hugging Face architectures (random small configs) under the standard plans",
        description="Build each architecture of autopart.models.zoo from a small random config "
        "(needs transformers; nothing is downloaded), verify it under dp=2, tp=2, pp=2 1F1B, "
        "pp=2 Seq1F1B k=2, tp=2×pp=2 Seq1F1B k=2 and pp=2 Seq1F1B k=4 with forked gloo ranks, "
        "print one line per cell and write the compatibility matrix as Markdown.",
    )
    z.add_argument(
        "--models",
        metavar="A,B",
        default=None,
        help="architectures to check, comma-separated (default: all of autopart.models.zoo's: "
        "see docs/compatibility.md)",
    )
    z.add_argument(
        "--write",
        metavar="FILE",
        default=None,
        help="write the Markdown table there (e.g. docs/compatibility.md)",
    )
    z.add_argument(
        "--update",
        metavar="FILE",
        default=None,
        help="replace only the checked architectures' rows in that written table (and redo its "
        "counts), e.g. after fixing one model: --models phimoe --update docs/compatibility.md",
    )
    z.add_argument(
        "--check",
        metavar="FILE",
        default=None,
        help="compare the checked architectures' rows with that written table and exit 1 on "
        "any difference (dtype, tolerance, a verdict or a refusal), e.g. under another "
        "transformers release: --models mixtral --check docs/compatibility.md",
    )
    z.add_argument(
        "--timeout",
        type=positive_seconds,
        default=120.0,
        help="seconds any distributed wait may take (default 120)",
    )


def main(a: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from autopart.models import zoo

    archs = (
        [m.strip() for m in a.models.split(",") if m.strip()]
        if a.models
        else list(zoo.ARCHITECTURES)
    )
    # zoo.matrix would take an unknown name as a cell to verify: refuse it before any work
    unknown = [m for m in archs if m not in zoo.ARCHITECTURES]
    if unknown:
        raise AutopartError(
            f"no architecture {', '.join(unknown)} in autopart.models.zoo",
            hint=f"choose from {', '.join(zoo.ARCHITECTURES)}",
        )
    target = Path(a.update) if a.update else None
    for flag, name in (("--update", a.update), ("--check", a.check)):
        if name and not Path(name).is_file():  # before any work
            raise AutopartError(f"{flag} {name}: no such table", hint="write one with --write")
    con = Console()
    total, done = len(archs) * len(zoo.PLANS), [0]

    def show(arch: str, dtype: str, plan: str, cell) -> None:
        done[0] += 1
        word = zoo.verdict(cell)
        colour = {"PASS": "green", "FAIL": "red", "refused": "yellow"}[word]
        detail = (
            cell.message.splitlines()[0]
            if word == "refused"
            else (
                f"worst gradient {cell.worst} {cell.grad_error:.1e} (tolerance {cell.tolerance:.0e})"
            )
        )
        con.print(
            f"[{done[0]:3d}/{total}] {arch:12s} {plan:22s} [{colour}]{word}[/] {dtype}: {detail}",
            highlight=False,
            soft_wrap=True,
        )

    with con.status(f"verifying {len(archs)} architectures × {len(zoo.PLANS)} plans"):
        results = zoo.matrix(archs, timeout_s=a.timeout, on_result=show)
    text = zoo.table(results)
    summary = next(line for line in text.splitlines() if "cells PASS" in line)
    con.print(summary.replace("**", ""), highlight=False)
    if a.write:
        Path(a.write).write_text(text)
        con.print(f"wrote {a.write}", highlight=False)
    if target is not None:
        target.write_text(zoo.merge(target.read_text(), results))
        con.print(f"updated {len(results)} rows of {a.update}", highlight=False)
    differ = zoo.differences(Path(a.check).read_text(), results) if a.check else []
    for line in differ:
        con.print(f"[red]differs[/] {line}", highlight=False, soft_wrap=True)
    if a.check:
        con.print(
            f"{len(differ)} differences from {a.check}" if differ else f"every row as in {a.check}",
            highlight=False,
        )
    failed = any(zoo.verdict(c) == "FAIL" for _, cells in results.values() for c in cells.values())
    return 1 if failed or differ else 0
