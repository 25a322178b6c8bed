"""``autopart verify``: check the loss and every gradient of a plan against one device."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autopart.cli.common import plan_flags, plan_kwargs, spec_flag
from autopart.errors import AutopartError, positive_int, positive_seconds


def add_parser(sub: argparse._SubParsersAction) -> None:
    from autopart.parity.verify import DTYPES, PLANS_HELP

    v = sub.add_parser(
        "verify",
        help="check loss and every gradient against one device",
        description="Run one step of each plan on real gloo ranks and compare the loss and\n"
        "every gradient, by the model's parameter names, with the model on one device\n"
        "(float64 by default: PASS within 1e-9 relative, or the tolerance of the model's\n"
        "own lower-precision parts). Exit code 0 when every plan passes.",
        epilog="examples:\n"
        "  autopart verify --model examples/nanogpt.py:make --dp 2 --microbatches 2\n"
        '  autopart verify --model autopart.models.zoo:llama --plans "tp=2; pp=2,seq1f1b,k=2,m=2"'
        "\n  autopart verify --model examples/nanogpt.py:make --program out/   (out/'s plan)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    spec_flag(v)
    plan_flags(v)
    v.add_argument(
        "--dtype",
        default="float64",
        choices=tuple(DTYPES),
        help="precision of both runs (default float64)",
    )
    v.add_argument(
        "--timeout",
        type=positive_seconds,
        default=300.0,
        help="seconds any distributed wait may take (default 300)",
    )
    v.add_argument(
        "--compile",
        action="store_true",
        help="run the ranks' stage graphs through torch.compile (use --dtype float32)",
    )
    v.add_argument(
        "--nnodes",
        type=positive_int,
        default=1,
        help="torchrun agents meeting by c10d rendezvous on 127.0.0.1, as separate "
        "machines would (default 1)",
    )
    v.add_argument(
        "--plans",
        metavar="PLANS",
        default=None,
        help=f'check several plans in one call, e.g. "tp=2; pp=2,1f1b,m=4; '
        f'pp=2,seq1f1b,k=2,m=4": {PLANS_HELP}; the plan flags give what a plan leaves '
        "unset. The model is captured once, and all plans of one world size run in one "
        "torchrun launch",
    )
    v.add_argument(
        "--program",
        metavar="DIR",
        type=Path,
        default=None,
        help="check the plan of the program saved in DIR (its plan.json, e.g. what "
        "autopart plan --emit wrote) instead of the plan flags",
    )
    v.add_argument(
        "--in-memory",
        action="store_true",
        help="fork the ranks from this process with the compiled program in memory "
        "(as the live DeviceMesh API runs it) instead of saving it and launching "
        "torchrun: seconds faster per plan; no --nnodes or --compile",
    )


def _saved_plan(folder: Path) -> dict[str, Any]:
    """The ``Check`` keywords of the plan a saved program was compiled for."""
    from autopart.layout import Plan
    from autopart.program.format import read_head

    return Plan.from_json(read_head(folder)["plan"]).keywords()


def main(a: argparse.Namespace) -> int:
    from rich.console import Console

    from autopart.parity.verify import Check, Report, parse_plans, verify_many

    base = {"dp": a.dp, "tp": a.tp, "pp": a.pp, **plan_kwargs(a)}
    if a.program is not None:  # the folder's plan; which libraries to trust stays yours
        base = {**_saved_plan(a.program), "library_ops": tuple(a.library_ops)}
    checks = parse_plans(a.plans, a.model, base) if a.plans else [Check(a.model, **base)]
    con = Console()
    outcome = {"fail": 0, "error": 0}
    notes: dict[str, str] = {}

    def show(name: str, result: Report | AutopartError) -> None:
        if isinstance(result, AutopartError):
            outcome["error"] += 1
            if len(checks) == 1:
                raise result
            con.print(f"[red]ERROR[/] {name}: {result}", highlight=False)
            return
        outcome["fail"] += not result.ok
        if result.dropout_note():  # the reason a FAIL says nothing of the program: said once
            notes.setdefault(result.dropout_note().split(":")[0], result.dropout_note())
        verdict = "[green]PASS[/]" if result.ok else "[red]FAIL[/]"
        if len(checks) > 1:  # one line per plan
            con.print(
                f"{verdict} {name}: loss rel err {result.loss_error:.1e}, worst gradient "
                f"{result.worst} {result.grad_error:.1e} ({len(result.errors)} compared, "
                f"tolerance {result.tolerance:.0e}, {result.seconds:.1f} s)",
                highlight=False,
            )
            return
        con.print(
            f"loss: {result.loss:.15g} (single device {result.ref_loss:.15g}), "
            f"max rel error {result.loss_error:.3e}",
            highlight=False,
        )
        con.print(
            f"worst gradient: {result.worst}, max rel error {result.grad_error:.3e} "
            f"({len(result.errors)} gradients compared)",
            highlight=False,
        )
        con.print(
            f"{verdict} (tolerance {result.tolerance:.0e}, {a.dtype}, {result.seconds:.1f} s)",
            highlight=False,
        )

    what = f"{len(checks)} plans of" if len(checks) > 1 else "a plan of"
    with con.status(f"verifying {what} {a.model} against one device"):
        verify_many(
            checks,
            dtype=a.dtype,
            timeout_s=a.timeout,
            nnodes=a.nnodes,
            compile=a.compile,
            via="fork" if a.in_memory else "torchrun",
            on_result=show,
        )
    if len(checks) > 1:
        passed = len(checks) - outcome["fail"] - outcome["error"]
        con.print(
            f"{passed} of {len(checks)} plans pass, {outcome['fail']} fail, "
            f"{outcome['error']} errors",
            highlight=False,
        )
    for note in notes.values():
        con.print(f"[yellow]note:[/] {note}", highlight=False)
    return 2 if outcome["error"] else 1 if outcome["fail"] else 0
