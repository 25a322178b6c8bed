"""The ``autopart`` command: demo, verify, inspect, run, timeline, simulate, plan."""

from __future__ import annotations

import argparse
import math
import sys

from autopart.errors import AutopartError
from autopart.layout import SCHEDULES

EPILOG = """examples:
  autopart demo                                   train a small GPT on 4 CPU ranks (tp × pp), check parity
  autopart verify --model examples/nanogpt.py:make --dp 2 --microbatches 2
  autopart inspect --model examples/hf_gpt2.py:make --dp 2 --rank 1 --dot rank1.dot
  torchrun --standalone --nproc-per-node 2 -m autopart.runtime.run out/ --steps 10
  autopart run out/ --steps 10                    (launches torchrun itself when not under it)
  autopart timeline trace.json -o timeline.png    draw a --trace file: one row per rank
  autopart simulate --shape gpt3-175b --gpus 1024 --tp 8 --pp 8 --global-batch 1536
                                                  predict one iteration on a GPU cluster
  autopart plan --shape megatron-1t --gpus 3072 --global-batch 3072
                                                  search for the fastest plan that fits

a model SPEC is path/to/file.py:make or package.module:make, where make() returns
(model, (input_ids, labels)) with int64 (batch, seq) token tensors.
"""


def _plan_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan")
    g.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline ranks (default 1)")
    g.add_argument(
        "--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)"
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="micro-batches per data-parallel rank (default 1)",
    )
    g.add_argument(
        "--virtual-stages", type=int, default=1, help="virtual stages per rank (interleaving)"
    )
    g.add_argument(
        "--seq-chunks", type=int, default=1, help="Seq1F1B sequence chunks per micro-batch"
    )
    g.add_argument(
        "--seq-split",
        choices=("balanced", "uniform"),
        default="balanced",
        help="Seq1F1B chunk boundaries: equal work (default) or equal length",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split activations between tp regions along the sequence",
    )
    g.add_argument(
        "--max-stage-memory-gb",
        type=float,
        default=None,
        help="pipeline cuts keep each stage's weights, gradients, Adam states and "
        "in-flight activations under this many GiB",
    )


def _plan_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        schedule=a.schedule,
        microbatches=a.microbatches,
        virtual_stages=a.virtual_stages,
        seq_chunks=a.seq_chunks,
        seq_split=a.seq_split,
        sequence_parallel=a.sequence_parallel,
        max_stage_memory_gb=a.max_stage_memory_gb,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autopart",
        description="Compile an unmodified PyTorch GPT into one parallel program per rank.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser(
        "demo", help="train a small GPT on CPU ranks and check parity (no arguments needed)"
    )
    d.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    d.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    d.add_argument(
        "--schedule", default="seq1f1b", help=f"one of {', '.join(SCHEDULES)} (default seq1f1b)"
    )
    d.add_argument(
        "--seq-chunks",
        type=int,
        default=2,
        help="Seq1F1B sequence chunks per micro-batch (default 2)",
    )
    d.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    d.add_argument(
        "--no-sequence-parallel",
        dest="sequence_parallel",
        action="store_false",
        help="keep activations between tp regions whole (default: split along the sequence)",
    )
    d.add_argument("--microbatches", type=int, default=4, help="micro-batches per rank (default 4)")
    d.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    d.add_argument("--out", default="autopart-demo", help="output folder (default ./autopart-demo)")

    v = sub.add_parser("verify", help="check loss and every gradient against one device")
    v.add_argument(
        "--model", required=True, metavar="SPEC", help="path/to/file.py:make or module:make"
    )
    _plan_flags(v)
    v.add_argument(
        "--dtype", default="float64", choices=["float64", "float32"], help="precision of both runs"
    )
    v.add_argument(
        "--timeout", type=float, default=300.0, help="seconds any distributed wait may take"
    )
    v.add_argument(
        "--compile",
        action="store_true",
        help="run the ranks' stage graphs through torch.compile (use --dtype float32)",
    )
    v.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="torchrun agents meeting by c10d rendezvous on 127.0.0.1, as separate "
        "machines would (default 1)",
    )
    from autopart.parity.verify import PLANS_HELP

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
        "--in-memory",
        action="store_true",
        help="fork the ranks from this process with the compiled program in memory "
        "(as the live DeviceMesh API runs it) instead of saving it and launching "
        "torchrun: seconds faster per plan; no --nnodes or --compile",
    )

    z = sub.add_parser(
        "zoo",
        help="verify Hugging Face architectures (random small configs) under the standard plans",
        description="Build each architecture of autopart.models.zoo from a small random config "
        "(needs transformers; nothing is downloaded), verify it under dp=2, tp=2, pp=2 1F1B, "
        "pp=2 Seq1F1B k=2 and tp=2×pp=2 Seq1F1B k=2 with forked gloo ranks, print one line per "
        "cell and write the compatibility matrix as Markdown.",
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
        "--timeout",
        type=float,
        default=120.0,
        help="seconds any distributed wait may take (default 120)",
    )

    i = sub.add_parser("inspect", help="print costs per block and the per-rank programs")
    i.add_argument(
        "--model", required=True, metavar="SPEC", help="path/to/file.py:make or module:make"
    )
    _plan_flags(i)
    i.add_argument("--rank", default="0", help="rank to print, or 'all' (default 0)")
    i.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="sequence length for the Seq1F1B chunk table (default: the example's)",
    )
    i.add_argument("--dot", metavar="FILE", help="write the rank's stage graph as Graphviz DOT")
    i.add_argument(
        "--after",
        metavar="PASS",
        help="print the graph after this pass (e.g. capture, data_parallel)",
    )

    from autopart.runtime.run import build_parser as run_parser

    r = sub.add_parser(
        "run",
        help="run saved ranks (under torchrun, or launching it)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_parser(r)

    t = sub.add_parser("timeline", help="draw a trace (autopart run --trace) as a timeline PNG")
    t.add_argument("trace", metavar="TRACE", help="Chrome/Perfetto trace JSON")
    t.add_argument(
        "-o",
        "--out",
        default=None,
        metavar="PNG",
        help="picture to write (default: TRACE with .png)",
    )
    t.add_argument("--title", default="", help="title above the picture (default: the file name)")
    _simulate_parsers(sub)
    return p


SIM_EPILOG = """examples:
  autopart simulate --shape megatron-1t --gpus 3072 --tp 8 --pp 64 --virtual-stages 2 \\
      --schedule interleaved-1f1b --global-batch 3072 --recompute full --attention unfused
  autopart simulate --layers 96 --hidden 12288 --heads 96 --vocab 51200 --seq 2048 \\
      --gpus 1024 --tp 8 --pp 16 --global-batch 1536 --schedule seq1f1b --seq-chunks 4 --json
  autopart simulate --model examples/gpt7b.py:make --seq 4096 --cluster dgx-h100 --gpus 64 \\
      --tp 8 --pp 2 --global-batch 512 --trace sim.json   (then: autopart timeline sim.json)
  autopart simulate --measured run.json --global-batch 16
      (run.json from: autopart run DIR --steps 3 --trace run.json; predicts DIR's layout at 16
      sequences per step from the costs measured there)

model shapes (--shape): gpt3-175b, megatron-1t, gpt-7b. clusters (--cluster): dgx-a100-80gb,
dgx-h100, or a .toml / .json file (see docs/simulate.md).
"""

PLAN_EPILOG = """examples:
  autopart plan --shape megatron-1t --gpus 3072 --global-batch 3072
  autopart plan --shape gpt3-175b --gpus 1024 --global-batch 1536 --cluster dgx-h100 --top 10
  autopart plan --model examples/gpt7b.py:make --seq 4096 --gpus 64 --global-batch 256 --json
"""


def _model_flags(p: argparse.ArgumentParser, gpus_required: bool = True) -> None:
    g = p.add_argument_group("model (one of --model, --shape, or the shape flags)")
    g.add_argument(
        "--model", metavar="SPEC", help="capture path/to/file.py:make and read its shape"
    )
    g.add_argument("--shape", metavar="NAME", help="a named shape: gpt3-175b, megatron-1t, gpt-7b")
    for name, text in (
        ("layers", "transformer blocks"),
        ("hidden", "model width"),
        ("heads", "attention heads"),
        ("vocab", "vocabulary size"),
    ):
        g.add_argument(f"--{name}", type=int, help=text)
    g.add_argument("--seq", type=int, help="sequence length (default with --model: the example's)")
    g.add_argument("--kv-heads", type=int, help="K/V heads (default: --heads)")
    g.add_argument("--ffn", type=int, help="MLP width (default 4 × hidden)")
    g.add_argument("--untied", action="store_true", help="the LM head does not share the embedding")
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--cluster",
        default="dgx-a100-80gb",
        help="dgx-a100-80gb (default), dgx-h100, or a .toml / .json file",
    )
    c.add_argument("--gpus", type=int, required=gpus_required, help="GPUs in all")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _simulate_parsers(sub: argparse._SubParsersAction) -> None:
    from autopart.planning.simulate import ATTENTION, RECOMPUTE

    s = sub.add_parser(
        "simulate",
        help="predict one training iteration on a GPU cluster",
        epilog=SIM_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --measured must see every flag given
    )
    _model_flags(s, gpus_required=False)
    s.add_argument(
        "--measured",
        metavar="TRACE",
        help="replay the per-action costs of a real run here (the trace of autopart run "
        "DIR --trace TRACE) instead of a model and cluster: predicts that layout with "
        "--global-batch sequences or --schedule (docs/simulate.md, 'Calibration')",
    )
    g = s.add_argument_group("plan (dp = gpus / (tp × pp))")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline ranks (default 1)")
    g.add_argument("--virtual-stages", type=int, default=1, help="virtual stages per pipeline rank")
    g.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)"
    )
    g.add_argument(
        "--global-batch",
        type=int,
        help="sequences per iteration (required, except with --measured: the run's)",
    )
    g.add_argument(
        "--schedule",
        default=None,
        help=f"one of {', '.join(SCHEDULES)} (default 1f1b; with --measured, the run's)",
    )
    g.add_argument("--seq-chunks", type=int, default=1, help="Seq1F1B sequence chunks (default 1)")
    g.add_argument(
        "--seq-split",
        choices=("balanced", "uniform"),
        default="balanced",
        help="Seq1F1B chunk boundaries (default balanced)",
    )
    g.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="none",
        help="activation recomputation (default none)",
    )
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism")
    g.add_argument(
        "--attention",
        choices=ATTENTION,
        default="flash",
        help="attention kernel: fused causal (default) or unfused (Megatron 2021)",
    )
    g.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="shard the optimizer state over dp (Megatron's distributed optimizer)",
    )
    s.add_argument("--trace", metavar="FILE", help="write the simulated pipeline as a Chrome trace")
    s.add_argument(
        "--ignore-memory",
        action="store_true",
        help="predict a plan even when it does not fit the GPUs' memory (default: "
        "refuse it, saying by how much and what would fit)",
    )
    pl = sub.add_parser(
        "plan",
        help="search for the fastest plan that fits in memory",
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_flags(pl)
    pl.add_argument("--global-batch", type=int, required=True, help="sequences per iteration")
    pl.add_argument("--top", type=int, default=5, help="plans to print (default 5)")
    pl.add_argument(
        "--schedules",
        nargs="+",
        default=list(SCHEDULES),
        metavar="NAME",
        help="schedules to try (default: all)",
    )
    pl.add_argument(
        "--micro-batches",
        nargs="+",
        type=int,
        default=[1, 2, 4, 8],
        metavar="B",
        help="micro-batch sizes to try (default 1 2 4 8)",
    )
    pl.add_argument(
        "--seq-chunks",
        nargs="+",
        type=int,
        default=[2, 4, 8],
        metavar="K",
        help="Seq1F1B chunk counts to try (default 2 4 8)",
    )
    pl.add_argument(
        "--recompute",
        nargs="+",
        choices=RECOMPUTE,
        default=list(RECOMPUTE),
        help="recompute modes to try (default: all)",
    )
    pl.add_argument(
        "--attention",
        choices=ATTENTION,
        default="flash",
        help="attention kernel of every plan (default flash)",
    )
    pl.add_argument("--max-tp", type=int, default=None, help="largest tp (default: GPUs per node)")
    pl.add_argument("--no-progress", action="store_true", help="no progress display")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    args.raw_argv = raw
    if args.command is None:
        parser.print_help()
        return 0
    try:
        commands = {
            "demo": _demo,
            "verify": _verify,
            "inspect": _inspect,
            "run": _run,
            "timeline": _timeline,
            "simulate": _simulate,
            "plan": _plan,
            "zoo": _zoo,
        }
        return commands[args.command](args)
    except AutopartError as exc:
        print(f"autopart {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _demo(a: argparse.Namespace) -> int:
    from autopart.cli.demo import main as demo

    return demo(a)


def _verify(a: argparse.Namespace) -> int:
    from rich.console import Console

    from autopart.parity.verify import Check, Report, parse_plans, verify_many

    base = {"dp": a.dp, "tp": a.tp, "pp": a.pp, **_plan_kwargs(a)}
    checks = parse_plans(a.plans, a.model, base) if a.plans else [Check(a.model, **base)]
    con = Console()
    outcome = {"fail": 0, "error": 0}

    def show(name: str, result: Report | AutopartError) -> None:
        if isinstance(result, AutopartError):
            outcome["error"] += 1
            if len(checks) == 1:
                raise result
            con.print(f"[red]ERROR[/] {name}: {result}", highlight=False)
            return
        outcome["fail"] += not result.ok
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
    return 2 if outcome["error"] else 1 if outcome["fail"] else 0


def _zoo(a: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from autopart.models import zoo

    archs = (
        [m.strip() for m in a.models.split(",") if m.strip()]
        if a.models
        else list(zoo.ARCHITECTURES)
    )
    unknown = [m for m in archs if m not in zoo.ARCHITECTURES]
    if unknown:
        raise AutopartError(
            f"no architecture {', '.join(unknown)} in autopart.models.zoo",
            hint=f"choose from {', '.join(zoo.ARCHITECTURES)}",
        )
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
    return (
        1
        if any(zoo.verdict(c) == "FAIL" for _, cells in results.values() for c in cells.values())
        else 0
    )


def _inspect(a: argparse.Namespace) -> int:
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
    from autopart.layout import Mesh

    con = Console()
    mesh = Mesh(dp=a.dp, pp=a.pp, tp=a.tp)
    with con.status(f"building and capturing {a.model}"):
        model, batch = build(a.model)
        captured = capture(model, batch)
    print_costs(captured, con)
    if a.seq_chunks > 1:
        con.print(
            chunk_rich(
                captured,
                a.seq_len or captured.example_shape[1],
                a.seq_chunks,
                math.lcm(8, a.tp) if a.sequence_parallel else 8,
            )
        )
    with con.status(f"compiling for {mesh}"):
        program = parallelize(captured, mesh, **_plan_kwargs(a))
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
    ranks = range(program.mesh.size) if a.rank == "all" else [_rank(a.rank, program.mesh.size)]
    for r in ranks:
        print(program.rank(r), "\n")
        if program.mesh.tp > 1:
            con.print(parallel_table(program.rank(r), captured.example_shape))
    if a.dot:
        rp = program.rank(ranks[0])
        path = write_dot(rp.stages[0].graph, a.dot, f"rank {rp.rank} stage {rp.stages[0].stage}")
        con.print(f"wrote {path} (render: dot -Tsvg {path} -o graph.svg)")
    return 0


def _rank(text: str, size: int) -> int:
    if not text.isdigit() or int(text) >= size:
        raise AutopartError(
            f"--rank {text!r} is not a rank of this {size}-rank mesh", hint="use 0..N-1 or 'all'"
        )
    return int(text)


def _run(a: argparse.Namespace) -> int:
    import os

    from autopart.parity.verify import launch
    from autopart.program.format import read_head
    from autopart.runtime.run import run

    if "RANK" in os.environ:
        return run(a)
    world = read_head(a.dir)["world_size"]
    rest = a.raw_argv[a.raw_argv.index("run") + 1 :]
    print(
        f"launching {world} ranks: torchrun --standalone --nproc-per-node {world} -m autopart.runtime.run {' '.join(rest)}"
    )
    launch(world, ["-m", "autopart.runtime.run", *rest], stream=True, timeout_s=None)
    return 0


def _timeline(a: argparse.Namespace) -> int:
    from pathlib import Path

    from autopart.runtime.timeline import busy_fractions, load_trace, plot_timeline

    events = load_trace(a.trace)
    out = plot_timeline(events, a.out or Path(a.trace).with_suffix(".png"), a.title or a.trace)
    for rank, frac in busy_fractions(events).items():
        print(f"rank {rank}: {frac:.1%} busy")
    print(f"wrote {out}")
    return 0


def _shape(a: argparse.Namespace):
    from autopart.planning.simulate import resolve_shape

    return resolve_shape(
        a.model,
        a.shape,
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        vocab=a.vocab,
        seq=a.seq,
        kv_heads=a.kv_heads,
        ffn=a.ffn,
        tied=not a.untied,
    )


def _simulate(a: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from autopart.planning.simulate import Strategy, print_summary, simulate

    if a.measured is not None:
        return _simulate_measured(a)
    for flag, value in (("--gpus", a.gpus), ("--global-batch", a.global_batch)):
        if value is None:
            raise AutopartError(
                f"simulate needs {flag}", hint="or --measured TRACE to replay a run measured here"
            )
    if a.gpus % (a.tp * a.pp):
        raise AutopartError(
            f"--gpus {a.gpus} is not divisible by tp × pp = {a.tp * a.pp}",
            hint="dp = gpus / (tp × pp) must be a whole number",
        )
    strategy = Strategy(
        tp=a.tp,
        pp=a.pp,
        dp=a.gpus // (a.tp * a.pp),
        virtual_stages=a.virtual_stages,
        micro_batch=a.micro_batch,
        global_batch=a.global_batch,
        schedule=a.schedule or "1f1b",
        seq_chunks=a.seq_chunks,
        seq_split=a.seq_split,
        recompute=a.recompute,
        sequence_parallel=a.sequence_parallel,
        distributed_optimizer=a.distributed_optimizer,
        attention=a.attention,
    )
    shape = _shape(a)
    sim = simulate(
        shape, a.cluster, strategy, record=bool(a.trace), extrapolate=False if a.trace else None
    )
    if not sim.summary["fits"] and not a.ignore_memory:
        _does_not_fit(shape, sim)
    if a.trace:
        with open(a.trace, "w") as f:
            json.dump({"traceEvents": sim.chrome_trace()}, f)
    if a.json:
        print(json.dumps(sim.summary))
    else:
        con = Console()
        con.print(sim.shape.describe())
        print_summary(sim.summary, con)
        if a.trace:
            con.print(f"wrote {a.trace} (draw it: autopart timeline {a.trace})")
    return 0


def _does_not_fit(shape, sim) -> None:
    """Refuse a simulated plan over the cluster's memory: by how much, and what would fit."""
    from autopart.planning.cluster import GIB
    from autopart.planning.planner import fitting_alternatives

    mem = sim.summary["memory"]
    over = mem["total"] - mem["usable"]
    fits = fitting_alternatives(shape, sim.cluster, sim.strategy)
    hint = (
        "these fit: "
        + "; ".join(f"{alt.describe()} needs {need / GIB:.1f} GiB" for alt, need in fits)
        + "."
        if fits
        else "no single change of layout fits; more GPUs or a smaller model may."
    )
    raise AutopartError(
        f"{sim.strategy.describe()} does not fit: rank {mem['rank']} needs {mem['total']:.1f} GiB "
        f"per GPU ({mem['parameters']:.1f} parameters, {mem['gradients']:.1f} gradients, "
        f"{mem['optimizer']:.1f} optimizer state, {mem['activations']:.1f} activations), "
        f"{over:.1f} GiB over the {mem['usable']:.1f} usable on {sim.cluster.name}",
        hint=f"{hint} autopart plan searches every layout; --ignore-memory prints the "
        "prediction anyway",
    )


_NOT_MEASURED = (
    "--model",
    "--shape",
    "--layers",
    "--hidden",
    "--heads",
    "--vocab",
    "--seq",
    "--kv-heads",
    "--ffn",
    "--untied",
    "--cluster",
    "--gpus",
    "--tp",
    "--pp",
    "--virtual-stages",
    "--micro-batch",
    "--seq-chunks",
    "--seq-split",
    "--recompute",
    "--sequence-parallel",
    "--attention",
    "--distributed-optimizer",
    "--ignore-memory",
)


def _simulate_measured(a: argparse.Namespace) -> int:
    """``simulate --measured TRACE``: the measured layout, predicted from its own action costs."""
    import json

    from rich.console import Console

    from autopart.planning.calibrate import load, predict, print_prediction

    given = [f for f in _NOT_MEASURED if any(x == f or x.startswith(f + "=") for x in a.raw_argv)]
    if given:
        raise AutopartError(
            f"{given[0]} does not go with --measured: the model, cluster and "
            "layout are the measured run's",
            hint="--measured takes --global-batch, --schedule, --json and --trace",
        )
    m = load(a.measured)
    mb = None
    if a.global_batch is not None:
        per = m.dp * m.microbatch_size
        if not per:
            raise AutopartError(
                f"{a.measured} does not record the micro-batch size",
                hint="re-measure with this version of autopart run",
            )
        if a.global_batch % per or a.global_batch < per:
            raise AutopartError(
                f"--global-batch {a.global_batch} is not a whole number of "
                f"micro-batches of {m.microbatch_size} sequences on {m.dp} dp ranks",
                hint=f"use a multiple of {per} (the run measured {per * m.microbatches})",
            )
        mb = a.global_batch // per
    name = a.schedule or m.schedule
    if "interleaved" in name and m.pp > 1 and (mb or m.microbatches) % m.pp:
        per_round = m.dp * m.microbatch_size * m.pp
        raise AutopartError(
            f"{name} needs a multiple of pp={m.pp} micro-batches; --global-batch "
            f"{a.global_batch} gives {mb}",
            hint=f"use a multiple of {per_round} for --global-batch",
        )
    pred = predict(m, microbatches=mb, schedule=a.schedule, record=bool(a.trace))
    if a.trace:
        from autopart.planning.simulate import to_chrome_trace

        with open(a.trace, "w") as f:
            json.dump({"traceEvents": to_chrome_trace(pred.timeline.events)}, f)
    if a.json:
        print(json.dumps(pred.summary))
    else:
        con = Console()
        print_prediction(pred.summary, con)
        if a.trace:
            con.print(f"wrote {a.trace} (draw it: autopart timeline {a.trace})")
    return 0


def _plan(a: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from autopart.planning.planner import print_search, search

    shape = _shape(a)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
