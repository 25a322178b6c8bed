"""``autopart inspect``: the cost table per block, the per-rank summary and the rank programs,
offline (no ranks are launched)."""

from __future__ import annotations

import argparse

from autopart.cli.common import plan_flags, plan_kwargs, spec_flag
from autopart.errors import AutopartError, positive_int


def _rank(text: str) -> int | str:
    """``--rank``: a rank number or ``all`` (the program says whether the rank exists)."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank number or 'all'") from None


def _flex_summary(rp) -> str:
    """What ``attention="flex"`` lowers in this rank's stages (the runtime's own lowering, on
    copies; a rank compiling for CUDA also keeps heads below 16 dims)."""
    from autopart.graph import copy_graph
    from autopart.runtime import flex

    return flex.summary({st.stage: flex.lower_attention(copy_graph(st.graph)) for st in rp.stages})


def add_parser(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser(
        "inspect",
        help="print costs per block and the per-rank programs",
        description="Capture the model, print its cost per block and the plan's pipeline cut, "
        "then the generated program of one rank (or all): its stage graphs with their "
        "collectives (--after PASS: the graph after that pass instead; --dot: Graphviz).",
    )
    spec_flag(i)
    plan_flags(i)
    i.add_argument("--rank", type=_rank, default=0, help="rank to print, or 'all' (default 0)")
    i.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help="sequence length for the Seq1F1B chunk table (default: the example's)",
    )
    i.add_argument("--dot", metavar="FILE", help="write the rank's stage graph as Graphviz DOT")
    i.add_argument(
        "--after",
        metavar="PASS",
        help="print the graph after this pass (e.g. capture, data_parallel)",
    )


def main(a: argparse.Namespace) -> int:
    from rich.console import Console

    from autopart.api import parallelize
    from autopart.cli.report import (
        balance_table,
        chunk_rich,
        parallel_table,
        print_costs,
        write_dot,
    )
    from autopart.frontend.capture import capture
    from autopart.frontend.spec import build
    from autopart.layout import Mesh, Plan

    con = Console()
    mesh = Mesh(dp=a.dp, pp=a.pp, tp=a.tp)
    plan = Plan(mesh, **plan_kwargs(a))  # refuses a bad plan before the model is built
    with con.status(f"building and capturing {a.model}"):
        model, batch = build(a.model)
        captured = capture(model, batch)
    print_costs(captured, con)
    if plan.seq_chunks > 1:
        con.print(
            chunk_rich(
                captured,
                a.seq_len or captured.example_shape[1],
                plan.seq_chunks,
                plan.chunk_multiple,
            )
        )
    with con.status(f"compiling for {mesh}"):
        program = parallelize(captured, mesh, **plan_kwargs(a))
    program.summary(con)
    balance = balance_table(program)
    if balance is not None:
        con.print(balance)
    if a.after:
        names = [h.name for h in program.history]
        if a.after not in names:
            raise AutopartError(f"no pass named {a.after!r}", hint=f"passes: {', '.join(names)}")
        print(program.history[names.index(a.after)].code)
        return 0
    shown = program.ranks if a.rank == "all" else [program.rank(a.rank)]
    for rp in shown:
        print(rp, "\n")
        if program.mesh.tp > 1:
            con.print(parallel_table(rp, captured.example_shape))
        if plan.attention == "flex":  # what this rank will lower when it starts
            print(f"rank {rp.rank}: {_flex_summary(rp)}\n")
    if a.dot:
        rp = shown[0]
        path = write_dot(rp.stages[0].graph, a.dot, f"rank {rp.rank} stage {rp.stages[0].stage}")
        con.print(f"wrote {path} (render: dot -Tsvg {path} -o graph.svg)")
    return 0
