"""``autopart demo``: the whole flow on this machine, with no arguments.

Builds a small nanoGPT-style model, compiles it for a tensor × pipeline (× data) parallel mesh, saves the per-rank
programs, trains them with torchrun on this CPU for a few steps (loss per step), then checks
parity against one device and says where everything was written.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.panel import Panel

from autopart.errors import AutopartError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPEC = str(EXAMPLES / "nanogpt.py") + ":make"


def corpus(vocab: int, n: int = 200_000, seed: int = 0) -> torch.Tensor:
    """Synthetic text with structure a GPT can learn: noisy repetitions of a few phrases."""
    g = torch.Generator().manual_seed(seed)
    phrases = [torch.randint(0, vocab, (int(torch.randint(5, 12, (1,), generator=g)),), generator=g)
               for _ in range(8)]  # fmt: skip
    out, size = [], 0
    while size < n:
        p = phrases[int(torch.randint(0, len(phrases), (1,), generator=g))]
        out.append(p)
        size += p.numel()
    return torch.cat(out)[:n]


def main(args: argparse.Namespace) -> int:
    from autopart import Mesh, parallelize
    from autopart.report import print_costs
    from autopart.spec import load_factory
    from autopart.verify import launch, verify

    if not (EXAMPLES / "nanogpt.py").exists():
        raise AutopartError(f"the demo model {EXAMPLES / 'nanogpt.py'} is missing",
                            hint="run the demo from a checkout installed with pip install -e .")  # fmt: skip
    nanogpt = load_factory(SPEC).__globals__
    GPT, GPTConfig, batch = nanogpt["GPT"], nanogpt["GPTConfig"], nanogpt["batch"]

    con = Console()
    out = Path(args.out)
    mesh = Mesh(dp=args.dp, tp=args.tp, pp=args.pp)
    args.sequence_parallel = args.sequence_parallel and args.tp > 1
    con.print(Panel.fit(
        f"autopart demo: nanoGPT-style model → {mesh}{' + sequence parallel' if args.sequence_parallel else ''}"
        f" × {args.microbatches} micro-batches → {mesh.size} ranks under torchrun (gloo, CPU)", style="bold"))  # fmt: skip
    cfg = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=128, block_size=64)

    def factory():  # the demo model, the same weights every call
        torch.manual_seed(0)
        return GPT(cfg), batch(cfg, batch_size=8, seq_len=32)

    model, example = factory()
    start = time.perf_counter()
    with con.status("capturing the model with torch.export and compiling the rank programs"):
        from autopart.capture import capture

        captured = capture(model, example)
        print_costs(captured, con)
        program = parallelize(
            captured,
            mesh,
            schedule=args.schedule,
            microbatches=args.microbatches,
            virtual_stages=2 if args.schedule == "interleaved-1f1b" else 1,
            sequence_parallel=args.sequence_parallel,
        )
    con.print(f"compiled in {time.perf_counter() - start:.1f} s")
    program.summary(con)
    saved = program.save(out / "program")
    tokens = out / "tokens.pt"
    torch.save(corpus(cfg.vocab_size), tokens)
    con.print(f"\n[bold]training {args.steps} steps[/] on {mesh.size} ranks "
              f"(torchrun --nproc-per-node {mesh.size} -m autopart.run {saved} --tokens {tokens})")  # fmt: skip
    launch(mesh.size, ["-m", "autopart.run", str(saved), "--tokens", str(tokens), "--steps", str(args.steps),
                     "--lr", "3e-3", "--trace", str(out / "trace.json")], stream=True)  # fmt: skip
    con.print("\n[bold]parity check[/] (float64, one step, every gradient vs one device)")
    report = verify(
        factory,
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        schedule=args.schedule,
        virtual_stages=2 if args.schedule == "interleaved-1f1b" else 1,
        microbatches=args.microbatches,
        sequence_parallel=args.sequence_parallel,
    )
    con.print(("[green]" if report.ok else "[red]") + str(report))
    con.print(Panel.fit(
        f"outputs in {out.resolve()}\n"
        f"  program/plan.json         the plan\n"
        f"  program/rank00000/        rank 0: stageK.py (readable graphs), stageK.pt2, program.json, weights.pt\n"
        f"  trace.json                the last step's action timeline per rank (https://ui.perfetto.dev)\n"
        f"  tokens.pt                 the synthetic corpus\n"
        f"run again: torchrun --standalone --nproc-per-node {mesh.size} -m autopart.run {saved} --steps 20",
        title="done"))  # fmt: skip
    if not report.ok:
        raise AutopartError("the demo's parity check failed", hint="please report this as a bug")
    return 0
