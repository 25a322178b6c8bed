"""``autopart demo``: the whole flow on this machine, with no arguments.

Builds a small nanoGPT-style model over bytes (vocabulary 256), compiles it for tp=2 × pp=2 with
Seq1F1B sequence chunks and sequence parallelism (flags change the layout), saves the per-rank
programs, trains them with torchrun on this CPU on a real text shipped with autopart
(``autopart/models/data/corpus.txt``: its own documentation's prose, public domain), then checks parity
against one device and says where everything was written.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.panel import Panel

from autopart.errors import AutopartError, positive_int
from autopart.schedule.generators import traits

CORPUS = Path(__file__).resolve().parents[1] / "models" / "data" / "corpus.txt"
SEQ = 64  # tokens (bytes) per sequence


def corpus() -> torch.Tensor:
    """The shipped text as byte ids (a 1-D int64 tensor)."""
    if not CORPUS.exists():
        raise AutopartError(
            f"the demo corpus {CORPUS} is missing",
            hint="reinstall autopart (pip install -e .) from a complete checkout",
        )
    return torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()


def add_parser(sub: argparse._SubParsersAction) -> None:
    from autopart.layout import SCHEDULES
    from autopart.schedule.chunks import SPLITS

    d = sub.add_parser(
        "demo",
        help="train a small GPT on CPU ranks and check parity (no arguments needed)",
        description="Compile the built-in nanoGPT for tp=2 × pp=2 with Seq1F1B (by default), "
        "train it on the shipped text on 4 CPU ranks with torchrun, check one step's loss and "
        "gradients against one device, and write the program, a trace and a timeline to --out.",
    )
    d.add_argument("--dp", type=positive_int, default=1, help="data-parallel ranks (default 1)")
    d.add_argument("--pp", type=positive_int, default=2, help="pipeline ranks (default 2)")
    d.add_argument(
        "--schedule", default="seq1f1b", help=f"one of {', '.join(SCHEDULES)} (default seq1f1b)"
    )
    d.add_argument(
        "--seq-chunks",
        type=positive_int,
        default=2,
        help="Seq1F1B sequence chunks per micro-batch (default 2)",
    )
    d.add_argument(
        "--seq-split",
        choices=SPLITS,
        default="measured",
        help="Seq1F1B chunk boundaries: measured (balanced by the chunk forward times the first "
        "steps measure, the default), balanced (by FLOPs) or uniform",
    )
    d.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel ranks (default 2)")
    d.add_argument(
        "--no-sequence-parallel",
        dest="sequence_parallel",
        action="store_false",
        help="keep activations between tp regions whole (default: split along the sequence)",
    )
    d.add_argument(
        "--microbatches", type=positive_int, default=4, help="micro-batches per rank (default 4)"
    )
    d.add_argument("--steps", type=positive_int, default=100, help="training steps (default 100)")
    d.add_argument(
        "--precision",
        choices=("bf16",),
        default=None,
        help="bf16: bf16 compute, float32 master weights, gradients and loss (default: float32)",
    )
    d.add_argument("--out", default="autopart-demo", help="output folder (default ./autopart-demo)")


def main(args: argparse.Namespace) -> int:
    from autopart import Mesh, parallelize
    from autopart.cli.report import print_costs
    from autopart.models.nanogpt import GPT, GPTConfig
    from autopart.parity.verify import launch, verify

    con = Console()
    out = Path(args.out)
    mesh = Mesh(dp=args.dp, tp=args.tp, pp=args.pp)
    args.sequence_parallel = args.sequence_parallel and args.tp > 1
    con.print(
        Panel.fit(
            f"autopart demo: nanoGPT-style model → {mesh}{' + sequence parallel' if args.sequence_parallel else ''}"
            f" × {args.microbatches} micro-batches, {args.schedule}"
            f"{f' with {args.seq_chunks} sequence chunks' if traits(args.schedule).chunked else ''}"
            f" → {mesh.size} ranks under torchrun (gloo, CPU), trained on {CORPUS.name} as bytes",
            style="bold",
        )
    )
    cfg = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=2 * SEQ)
    text = corpus()

    def factory():  # the demo model, the same weights every call, and a batch of the text
        torch.manual_seed(0)
        rows = torch.stack([text[i : i + SEQ + 1] for i in range(0, 8 * 997, 997)])
        return GPT(cfg), (rows[:, :-1].contiguous(), rows[:, 1:].contiguous())

    model, example = factory()
    start = time.perf_counter()
    with con.status("capturing the model with torch.export and compiling the rank programs"):
        from autopart.frontend.capture import capture, capture_mixed

        bf16 = args.precision == "bf16"
        captured = capture_mixed(model, example) if bf16 else capture(model, example)
        print_costs(captured, con)
        program = parallelize(
            captured,
            mesh,
            schedule=args.schedule,
            microbatches=args.microbatches,
            virtual_stages=2 if traits(args.schedule).interleaved else 1,
            seq_chunks=args.seq_chunks if traits(args.schedule).chunked else 1,
            seq_split=args.seq_split,
            sequence_parallel=args.sequence_parallel,
            precision=args.precision,
        )
    con.print(f"compiled in {time.perf_counter() - start:.1f} s")
    program.summary(con)
    saved = program.save(out / "program")
    tokens = out / "tokens.pt"
    torch.save(text, tokens)
    con.print(
        f"\n[bold]training {args.steps} steps[/] on {mesh.size} ranks "
        f"(torchrun --nproc-per-node {mesh.size} -m autopart.runtime.run {saved} --tokens {tokens})"
    )
    trace, picture = out / "trace.json", out / "timeline.png"
    launch(
        mesh.size,
        [
            "-m",
            "autopart.runtime.run",
            str(saved),
            "--tokens",
            str(tokens),
            "--steps",
            str(args.steps),
            "--lr",
            "3e-3",
            "--trace",
            str(trace),
            "--timeline",
            str(picture),
        ],
        stream=True,
        timeout_s=None,  # a run as long as --steps asks; each wait in the ranks has its own bound
    )
    con.print(
        f"\n[bold]parity check[/] ({'bf16 compute, float32 masters' if bf16 else 'float64'}, "
        "one step, every gradient vs one device; ranks forked with the program in memory)"
    )
    report = verify(
        factory,
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        schedule=args.schedule,
        virtual_stages=2 if traits(args.schedule).interleaved else 1,
        seq_chunks=args.seq_chunks if traits(args.schedule).chunked else 1,
        microbatches=args.microbatches,
        seq_split=args.seq_split,
        sequence_parallel=args.sequence_parallel,
        via="fork",  # the program already ran from its files under torchrun above
        dtype="bfloat16" if bf16 else "float64",
    )
    con.print(("[green]" if report.ok else "[red]") + str(report))
    con.print(
        Panel.fit(
            f"outputs in {out.resolve()}\n"
            f"  program/plan.json         the plan\n"
            f"  program/rank00000/        rank 0: stageK.py (readable graphs), stageK.pt2, program.json, weights.pt\n"
            f"  trace.json                the last step's action timeline per rank (https://ui.perfetto.dev)\n"
            f"  timeline.png              the same as a picture: one row per rank, blocks by micro-batch\n"
            f"  tokens.pt                 the training text as byte ids ({CORPUS.name}, {text.numel():,} bytes)\n"
            f"run again: torchrun --standalone --nproc-per-node {mesh.size} -m autopart.runtime.run {saved} --tokens {tokens} --steps 20",
            title="done",
        )
    )
    if not report.ok:
        raise AutopartError("the demo's parity check failed", hint="please report this as a bug")
    return 0
