"""``autopart plan``: search for the fastest plan of a model that fits a cluster's memory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autopart.cli.common import MODEL_DEFAULTS, fill_defaults, model_flags, model_shape
from autopart.errors import AutopartError, positive_int

EPILOG = """examples:
  autopart plan --shape megatron-1t --gpus 3072 --global-batch 3072
  autopart plan --shape gpt3-175b --gpus 1024 --global-batch 1536 --cluster dgx-h100 --top 10
  autopart plan --model examples/gpt7b.py:make --seq 4096 --gpus 64 --global-batch 256 --json
  autopart plan --model examples/nanogpt.py:make --gpus 4 --global-batch 8 --emit out/
      (then: autopart run out/ --steps 20; autopart verify --model ... --program out/)
"""


def _listed(values) -> str:
    return " ".join(str(v) for v in values)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from autopart.layout import RECOMPUTE, SCHEDULES
    from autopart.planning.cluster import ATTENTION
    from autopart.planning.planner import MICRO_BATCHES, SEQ_CHUNKS

    pl = sub.add_parser(
        "plan",
        help="search for the fastest plan that fits in memory",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_flags(pl)
    pl.add_argument(
        "--global-batch", type=positive_int, required=True, help="sequences per iteration"
    )
    pl.add_argument("--top", type=positive_int, default=5, help="plans to print (default 5)")
    pl.add_argument(
        "--schedules",
        nargs="+",
        default=list(SCHEDULES),
        metavar="NAME",
        help=f"schedules to try (default: all: {_listed(SCHEDULES)})",
    )
    pl.add_argument(
        "--micro-batches",
        nargs="+",
        type=positive_int,
        default=list(MICRO_BATCHES),
        metavar="B",
        help=f"micro-batch sizes to try (default {_listed(MICRO_BATCHES)})",
    )
    pl.add_argument(
        "--seq-chunks",
        nargs="+",
        type=positive_int,
        default=list(SEQ_CHUNKS),
        metavar="K",
        help=f"Seq1F1B chunk counts to try (default {_listed(SEQ_CHUNKS)})",
    )
    pl.add_argument(
        "--recompute",
        nargs="+",
        choices=RECOMPUTE,
        default=list(RECOMPUTE),
        help="recompute modes to try (default: all; selective recomputes attention cores, so "
        "it only counts with --attention unfused)",
    )
    pl.add_argument(
        "--attention",
        choices=ATTENTION,
        default=None,
        help="attention kernel of every plan (default: the cluster's, flash on the presets)",
    )
    pl.add_argument(
        "--max-tp", type=positive_int, default=None, help="largest tp (default: GPUs per node)"
    )
    pl.add_argument("--no-progress", action="store_true", help="no progress display")
    pl.add_argument(
        "--emit",
        metavar="DIR",
        type=Path,
        default=None,
        help="compile the best plan for the --model and save its program in DIR, ready for "
        "autopart run DIR (the global batch must be the model's example batch)",
    )


def main(a: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from autopart.planning.planner import print_search, search

    fill_defaults(a, MODEL_DEFAULTS)
    if a.emit is not None and a.model is None:
        raise AutopartError(
            "--emit compiles the best plan for a real model: give it as --model SPEC",
            hint="a named --shape or the shape flags have no weights to compile",
        )
    shape, captured = model_shape(a, captured=True)
    if a.emit is not None:
        _check_batch(captured, a.global_batch)  # before the search, not after it
    con = Console() if sys.stdout.isatty() else Console(width=150)  # a log file: room for the table
    if not a.json:
        con.print(
            f"planning {shape.describe()} on {a.gpus} × {a.cluster}, global batch {a.global_batch}"
        )
    result = search(
        shape,
        a.cluster,
        a.gpus,
        a.global_batch,
        top=a.top,
        schedules=a.schedules,
        micro_batches=a.micro_batches,
        seq_chunks=a.seq_chunks,
        recompute=a.recompute,
        attention=a.attention,
        max_tp=a.max_tp,
        progress=not a.no_progress,
    )
    if a.json:
        print(json.dumps(result.to_json()))
    else:
        print_search(result, con)
    if a.emit is not None:
        _emit(a, captured, result.ranked[0].plan, con)
    return 0


def _check_batch(captured, global_batch: int) -> None:
    """--emit compiles for the model's example batch: it must be the planned global batch."""
    n = captured.example_shape[0]
    if n != global_batch:
        raise AutopartError(
            f"the model's example batch has {n} sequences, but the plan is "
            f"for a global batch of {global_batch}",
            hint=f"plan with --global-batch {n}, or make the example batch "
            f"{global_batch} sequences",
        )


def _emit(a: argparse.Namespace, captured, plan, con) -> None:
    """Compile ``plan`` (the planner's best) for the captured --model and save it in ``a.emit``."""
    from autopart.api import parallelize

    program = parallelize(captured, None, plan=plan)
    program.save(a.emit)
    (con.print if not a.json else lambda *x, **k: None)(
        f"wrote the program of {plan.describe()} to {a.emit}; run it with: "
        f"autopart run {a.emit} --steps 20",
        highlight=False,
    )
