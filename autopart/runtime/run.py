"""``python -m autopart.runtime.run DIR`` (also ``autopart run DIR``): run saved ranks under torchrun.

Each rank loads only its own folder of DIR (graphs, actions, weight shards), checks the world
size against the plan, and trains for ``--steps`` steps with AdamW on synthetic tokens (seeded,
the same global batch on every rank) or windows of a token file. Rank 0 prints the loss per step.

    torchrun --standalone --nproc-per-node 2 -m autopart.runtime.run out/ --steps 10
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopart import collectives
from autopart.errors import AutopartError, positive_int, positive_seconds
from autopart.frontend.capture import batch_fields, check_batch
from autopart.layout import Plan
from autopart.program.format import load_rank, load_weights, read_head
from autopart.runtime import dirlock, flex
from autopart.runtime.launch import rank_setup
from autopart.runtime.placement import backend_for, pick_device
from autopart.runtime.runner import Runner, join_torchrun, make_groups
from autopart.runtime.timeline import plot_timeline, trace_document


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(
        prog="python -m autopart.runtime.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", type=Path, help="folder written by Program.save() (holds plan.json)")
    p.add_argument("--steps", type=positive_int, default=5, help="training steps (default 5)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="global batch (default: the example's)",
    )
    p.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help="sequence length (default: the example's)",
    )
    p.add_argument(
        "--tokens",
        type=Path,
        default=None,
        help="token file: a torch.save'd 1-D integer tensor (.pt) or raw uint16 ids (.bin); "
        "without it (or --batch) the steps train on random tokens, whose loss need not fall",
    )
    p.add_argument(
        "--batch",
        type=Path,
        default=None,
        help="a torch.save'd (input_ids, labels), or dict of the batch's tensors by name "
        "(input_ids, labels, attention_mask, position_ids), used every step",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the synthetic data and of dropout masks (default 0)",
    )
    p.add_argument("--no-optim", action="store_true", help="compute gradients only, never step")
    p.add_argument(
        "--library-ops",
        action="append",
        default=[],
        metavar="NAMESPACE",
        help="a library whose custom ops (torch.ops.NAMESPACE.*) you trust the program to call: "
        "it is imported, after its installed version is checked against the one the program "
        "was compiled with (repeat for several; a program calling an unnamed one is refused)",
    )
    p.add_argument(
        "--zero",
        action="store_true",
        help="ZeRO-1: shard the AdamW state over the data-parallel ranks "
        "(torch's ZeroRedundancyOptimizer)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run each stage graph through torch.compile (Inductor); kernels are cached "
        "under ~/.cache/autopart/inductor, so a second run does not recompile",
    )
    p.add_argument(
        "--dump-params",
        type=Path,
        default=None,
        help="write each rank's parameter shards here after the last step",
    )
    p.add_argument(
        "--dump",
        type=Path,
        default=None,
        help="write each rank's first-step loss and gradients here",
    )
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=300.0,
        help="seconds any distributed wait may take (default 300)",
    )
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON line per step")
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write the last step's per-rank action timeline here (Chrome/Perfetto JSON) "
        "and print each rank's busy fraction and peak saved-activation bytes",
    )
    p.add_argument(
        "--timeline",
        type=Path,
        default=None,
        metavar="PNG",
        help="draw the last step's per-rank timeline to this PNG (see docs/timeline.md)",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="resume from the latest checkpoint in DIR if there is one, and save one "
        "there after the last step (see docs/checkpoint.md)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="also save a checkpoint after every N steps (needs --checkpoint-dir; default 0: "
        "only after the last step)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        default=0,
        metavar="K",
        help="keep only the K latest checkpoints in --checkpoint-dir (default 0: all)",
    )
    p.add_argument(
        "--fresh-optimizer",
        action="store_true",
        help="on resume, start the optimizer state afresh instead of loading it (needed to "
        "resume a checkpoint saved without optimizer state, e.g. by --no-optim; needs "
        "--checkpoint-dir)",
    )
    p.add_argument(
        "--other-model",
        action="store_true",
        help="on resume, load a checkpoint whose model computes otherwise (same parameter "
        "names and shapes, another graph: e.g. another dropout rate, or a new version "
        "capturing the model otherwise); refused by default (needs --checkpoint-dir)",
    )
    p.add_argument(
        "--device",
        default=None,
        metavar="DEV",
        help="where each rank computes: cpu, cuda (cuda:LOCAL_RANK), or meta (a dry run: "
        "shapes only, no data); default cuda:LOCAL_RANK with NCCL when CUDA is available, "
        "else cpu with gloo",
    )
    p.add_argument(
        "--export",
        type=Path,
        default=None,
        metavar="FILE",
        help="after training, rank 0 writes the single-device state dict of the final "
        "checkpoint to FILE (torch.save; needs --checkpoint-dir)",
    )
    return p


class Batches:
    """The global batch of each step: fixed, windows of a token file, or seeded random ids."""

    def __init__(self, args: argparse.Namespace, head: dict) -> None:
        self.b = args.batch_size or head["example_shape"][0]
        self.s = args.seq_len or head["example_shape"][1]
        self.vocab, self.seed = head["vocab_size"], args.seed
        self.fixed = _read_batch(args.batch) if args.batch else None
        self.names: tuple[str, ...] = ("input_ids", "labels")  # the program's (set per rank)
        self.tokens = _read_tokens(args.tokens) if args.tokens else None
        if self.tokens is not None and self.tokens.numel() <= self.s + 1:
            raise AutopartError(
                f"{args.tokens} holds {self.tokens.numel()} tokens, fewer than a "
                f"sequence of {self.s + 1}",
                hint="use a longer file or --seq-len",
            )
        if self.tokens is not None:  # the whole file once, before any step trains on it
            bad = (self.tokens < 0) | (self.tokens >= self.vocab)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise AutopartError(
                    f"{args.tokens}: token {i} is {int(self.tokens[i])}, outside the model's "
                    f"vocabulary of {self.vocab}",
                    hint="tokenize with the model's tokenizer (ids < vocabulary size)",
                )

    def __call__(self, step: int) -> Any:
        """The batch of ``step``: ``(input_ids, labels)``, or a dict by name when the program
        takes more (``capture.batch_fields`` reads either); generated batches of a program
        captured with an attention mask or positions get no padding (an all-ones mask) and
        one document a row (positions 0 … s − 1)."""
        if self.fixed is not None:
            return self.fixed
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if self.tokens is not None:
            starts = torch.randint(0, self.tokens.numel() - self.s - 1, (self.b,), generator=g)
            rows = torch.stack([self.tokens[i : i + self.s + 1] for i in starts.tolist()])
        else:
            rows = torch.randint(0, self.vocab, (self.b, self.s + 1), generator=g)
        ids, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        if tuple(self.names) == ("input_ids", "labels"):
            return ids, labels
        out = {"input_ids": ids, "labels": labels}
        if "attention_mask" in self.names:
            out["attention_mask"] = torch.ones(self.b, self.s, dtype=torch.int64)
        if "position_ids" in self.names:
            out["position_ids"] = torch.arange(self.s).expand(self.b, self.s).contiguous()
        return out


def _read_batch(path: Path) -> Any:
    """``--batch FILE``: a ``torch.save``d ``(input_ids, labels)`` or dict of the batch's
    tensors by name, checked as ``parallelize`` checks its example."""
    return check_batch(_load(path, "--batch"))


def _user_file(path: Path, flag: str) -> None:
    """Refuse a path the user named that is not a regular file, naming the flag."""
    if not path.is_file():
        raise AutopartError(
            f"{flag} {path}: " + ("no such file" if not path.exists() else "not a regular file")
        )


def _load(path: Path, flag: str) -> Any:
    """``torch.load(path, weights_only=True)`` of a file the user named, any failure (missing, a
    folder, not torch.save's zip, a pickle of other types) one ``AutopartError`` naming it."""
    _user_file(path, flag)
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, ...
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise AutopartError(
            f"{flag} {path} is not a file torch.save wrote: {type(exc).__name__}: {first[:200]}",
        ) from None


_TOKEN_DTYPES = frozenset(
    {torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64}
)


def _read_tokens(path: Path, what: str = "--tokens") -> torch.Tensor:
    """A token file: raw uint16 ids (``.bin``) or a torch.save'd 1-D integer tensor; ``what``
    names where it was given (a flag, a config key) in the refusals."""
    if path.suffix == ".bin":
        _user_file(path, what)
        raw = path.read_bytes()
        if not raw or len(raw) % 2:
            raise AutopartError(
                f"{what} {path} holds {len(raw)} bytes: raw uint16 ids are 2 bytes each"
            )
        return torch.frombuffer(bytearray(raw), dtype=torch.uint16).long()
    t = _load(path, what)
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise AutopartError(f"{path} must hold a 1-D tensor of token ids")
    if t.dtype not in _TOKEN_DTYPES:  # a cast would train on truncated floats or 0/1 flags
        raise AutopartError(
            f"{path} holds {t.dtype} values, not token ids",
            hint="save the ids as an integer tensor (torch.long, int32, uint16, ...)",
        )
    return t.long()


def dump(runner: Any, loss: torch.Tensor, folder: Path) -> None:
    """Write this rank's loss, local gradients and shard map to ``folder/rankNNNNN.pt``."""
    folder.mkdir(parents=True, exist_ok=True)
    grads = {
        f: (_host(p.grad) if p.grad is not None else None) for f, p in runner.named_parameters()
    }
    shards = {f: asdict(s) for f, s in runner.program.shards.items()}
    torch.save(
        {
            "loss": _host(loss),
            "grads": grads,
            "shards": shards,
            "coords": runner.program.coords.as_dict(),
            "saved": runner.peak_saved_bytes,
        },
        folder / f"rank{runner.rank:05d}.pt",
    )


def _host(t: torch.Tensor) -> torch.Tensor:
    """A copy to dump: on the CPU (a GPU rank's), or as it is (the dry run's meta tensors)."""
    return t.detach().clone() if t.device.type in ("cpu", "meta") else t.detach().cpu()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except AutopartError as exc:
        print(f"autopart run: error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if "RANK" in os.environ:  # a rank: stopped with its launcher, shared memory cleaned up
        rank_setup(collectives.close)
    _check_checkpoint_args(args)  # before reading anything
    head = read_head(args.dir)
    plan = Plan.from_json(head["plan"])
    batches = check_args(args, head, plan)
    device = pick_device(args.device)
    if os.environ.get("WORLD_SIZE", "").isdigit():  # torchrun's: refused before any rank
        plan.mesh.check_world(int(os.environ["WORLD_SIZE"]))  # connects (one rank's exit
        # during the others' connect was a raw "connectFullMesh failed" traceback)
    rank, world = join_torchrun(args.timeout, backend_for(device))
    # torch seeds its generator at random in each process; autopart's dropout takes explicit
    # seeds, but attention dropout inside SDPA draws from this generator
    torch.manual_seed((args.seed * 1_000_003 + rank) % 2**63)
    # rank 0 holds the checkpoint folder until this run ends (another run there is refused)
    held = dirlock.claim(args.checkpoint_dir) if rank == 0 and args.checkpoint_dir else None
    try:
        plan.mesh.check_world(world)
        program = load_rank(args.dir, rank, args.library_ops, head)  # plan.json read once
        batches.names = program.batch_names
        runner = Runner(
            program,
            plan,
            load_weights(args.dir, rank, program, head),
            make_groups(plan, rank, head.get("ties", program.ties)),
            timeout_s=args.timeout,
            seed=args.seed,
            compile=args.compile,
            device=device,
        )
        runner.tied = dict(head["tied"])
        if rank == 0 and plan.attention == "flex":
            print(f"autopart run: {flex.summary(runner.attention_lowered)}", flush=True)
        zero = args.zero or plan.distributed_optimizer  # the planner may have chosen it
        optim = None if args.no_optim else make_optimizer(runner, args.lr, zero)
        if args.trace is not None or args.timeline is not None:
            runner.timeline = []
        start, resumed = _resume(runner, optim, args, rank)
        last_s = _train(runner, optim, batches, args, rank, start, head["tied"])
        if args.checkpoint_dir is not None:
            _finish_checkpoints(runner, optim, args, rank, head["tied"], start, resumed)
        if args.trace is not None or args.timeline is not None:
            header = {
                "plan": {
                    "schedule": plan.schedule,
                    "microbatches": plan.microbatches,
                    "virtual_stages": plan.virtual_stages,
                    "seq_chunks": plan.seq_chunks,
                    "dp": plan.mesh.dp,
                    "tp": plan.mesh.tp,
                    "pp": plan.mesh.pp,
                },
                "microbatch_size": batches.b // (plan.mesh.dp * plan.microbatches),
                "microbatch_tokens": batches.b * batches.s // (plan.mesh.dp * plan.microbatches),
            }
            _write_trace(
                runner, args.trace, rank, args.timeline, _title(plan, args.dir), header, last_s
            )
        if args.dump_params is not None:
            args.dump_params.mkdir(parents=True, exist_ok=True)
            torch.save(
                {f: p.detach().clone() for f, p in runner.named_parameters()},
                args.dump_params / f"rank{rank:05d}.pt",
            )
    except BaseException:
        raise  # torchrun ends the other ranks; tearing groups down here could hang
    else:
        dist.barrier()  # every rank done with every collective before the groups go away
        dist.destroy_process_group()
    finally:
        if held is not None:
            held.close()
    return 0


def make_optimizer(runner, lr: float, zero: bool = False) -> torch.optim.Optimizer:
    """AdamW over this rank's shards; with ``zero``, its state sharded over the dp group (ZeRO-1:
    each dp rank keeps and updates 1/dp of the parameters, then broadcasts them). The parameters
    live in one flat bucket per dp rank (``parameters_as_bucket_view``), so the broadcast is one
    message per dp rank, not one per parameter (at 4 ranks on 2 cores that was 20 ms of a 375 ms
    step, ``docs/simulate.md``); a rank whose parameters mix dtypes keeps them apart."""
    dp = runner.groups.get("dp")
    params = list(runner.parameters())
    if not zero or dp is None:
        return torch.optim.AdamW(params, lr=lr)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    one_dtype = len({p.dtype for p in params}) == 1
    return ZeroRedundancyOptimizer(
        params,
        optimizer_class=torch.optim.AdamW,
        process_group=dp,
        lr=lr,
        parameters_as_bucket_view=one_dtype,
    )


def check_args(args: argparse.Namespace, head: dict, plan: Plan) -> Batches:
    """Every check the options allow before a rank starts (``autopart run`` calls it before it
    launches torchrun, so a bad flag is refused once, not once per rank); the batches."""
    _check_checkpoint_args(args)
    for flag, value in (("--steps", args.steps), ("--timeout", args.timeout)):
        if not value > 0:  # the parser's types refuse these; check_args is also called directly
            raise AutopartError(f"{flag} {value} must be positive")
    pick_device(args.device)
    batches = Batches(args, head)
    if args.batch is None:
        plan.check_batch(batches.b)
        if plan.max_seq is not None and batches.s > plan.max_seq:
            raise AutopartError(
                f"--seq-len {batches.s} is longer than the program's graphs fit "
                f"({plan.max_seq} tokens, found when it was compiled: a table of positions, "
                "a size export fixed, or attention masks proven up to that length)",
                hint=f"use --seq-len {plan.max_seq} or less, or capture the model with a "
                f"longer example",
            )
        if plan.min_seq is not None and batches.s < plan.min_seq:
            raise AutopartError(
                f"--seq-len {batches.s} is shorter than the program's graphs fit "
                f"({plan.min_seq} tokens, found when it was compiled)",
                hint=f"use --seq-len {plan.min_seq} or more, or capture the model with an "
                f"example of {batches.s} tokens",
            )
        if batches.s % plan.seq_block:
            raise AutopartError(
                f"--seq-len {batches.s} is not a multiple of {plan.seq_block} tokens, which the "
                "program's graphs need (found when it was compiled)",
                hint=f"use a multiple of {plan.seq_block}",
            )
        if plan.sequence_parallel and batches.s % plan.mesh.tp:
            raise AutopartError(
                f"--seq-len {batches.s} is not divisible by tp={plan.mesh.tp}, which sequence "
                "parallelism needs",
                hint=f"use a multiple of {plan.mesh.tp}",
            )
    if not (math.isfinite(args.lr) and args.lr >= 0):  # AdamW's own refusal came from every rank
        raise AutopartError(f"--lr {args.lr} must be a finite number ≥ 0")
    if (args.zero or args.lr != 1e-3) and args.no_optim:
        raise AutopartError(
            "--no-optim never steps, so --zero and --lr mean nothing with it",
            hint="drop --no-optim to train, or drop --zero / --lr",
        )
    return batches


def _check_checkpoint_args(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--checkpoint-every", args.checkpoint_every),
        ("--keep-checkpoints", args.keep_checkpoints),
    ):
        if value < 0:
            raise AutopartError(f"{flag} {value} must be 0 or more")
    if args.fresh_optimizer and args.no_optim:
        raise AutopartError("--fresh-optimizer needs an optimizer; --no-optim has none")
    # where the ranks write: a folder that is a file, or a file that is a folder, failed inside
    # the ranks (--export after the whole run)
    for flag, path, folder in (
        ("--checkpoint-dir", args.checkpoint_dir, True),
        ("--dump", args.dump, True),
        ("--dump-params", args.dump_params, True),
        ("--export", args.export, False),
        ("--trace", args.trace, False),
        ("--timeline", args.timeline, False),
    ):
        if path is not None and path.exists() and path.is_dir() != folder:
            raise AutopartError(
                f"{flag} {path} is {'a file' if folder else 'a folder'}, not "
                f"{'a folder' if folder else 'a file'} to write",
                hint=f"name a {'folder' if folder else 'file'} that does not exist or is one",
            )
    if args.checkpoint_dir is None:
        used = [
            f
            for f, on in (
                ("--checkpoint-every", args.checkpoint_every),
                ("--keep-checkpoints", args.keep_checkpoints),
                ("--export", args.export is not None),
                ("--fresh-optimizer", args.fresh_optimizer),
                ("--other-model", args.other_model),
            )
            if on
        ]
        if used:
            raise AutopartError(
                f"{used[0]} needs --checkpoint-dir",
                hint="add --checkpoint-dir DIR (a folder all ranks can write)",
            )


def _resume(runner, optim, args: argparse.Namespace, rank: int) -> tuple[int, Path | None]:
    """Load the newest intact checkpoint in --checkpoint-dir (verified; a damaged newer one is
    named in one line and skipped); returns its step and folder."""
    if args.checkpoint_dir is None:
        return 0, None
    from autopart.runtime import checkpoint  # lazy: torch.distributed.checkpoint (~1 s)

    damaged: list[str] = []

    def skipped(line: str) -> None:  # on every rank, the same lines
        damaged.append(line)
        if rank == 0:
            print(f"autopart run: {line}", file=sys.stderr, flush=True)

    found = checkpoint.latest(args.checkpoint_dir, runner, on_skip=skipped)  # on every rank
    if found is None and damaged:  # never start over silently from step 0 on top of them
        raise AutopartError(
            f"every checkpoint in {args.checkpoint_dir} is damaged ({len(damaged)} skipped)",
            hint="restore an intact step from a copy, or move the damaged steps away to start "
            "from step 0",
        )
    if found is None:
        return 0, None
    # --lr is this run's own (torch's habit would restore the saved one, silently overriding it)
    info = checkpoint.load(
        found,
        runner,
        optim,
        fresh_optimizer=args.fresh_optimizer,
        hyperparameters=False,
        other_model=args.other_model,
    )
    if info["seed"] != args.seed:
        raise AutopartError(
            f"{found} was trained with --seed {info['seed']}, not {args.seed}: "
            "the data order and dropout masks would change",
            hint=f"pass --seed {info['seed']}, or use a fresh --checkpoint-dir",
        )
    if rank == 0:
        how = "" if info["same_layout"] else f" (saved on mesh {info['mesh']}, resharded)"
        print(f"resumed from step {info['step']}: {found}{how}", flush=True)
    return info["step"], found


def _save(runner, optim, args: argparse.Namespace, rank: int, step: int, tied: dict) -> None:
    from autopart.runtime import checkpoint  # lazy: torch.distributed.checkpoint (~1 s)

    path = checkpoint.save(
        checkpoint.folder(args.checkpoint_dir, step),
        runner,
        optim,
        step,
        {"seed": args.seed},
        tied=tied,
    )
    if rank == 0 and args.keep_checkpoints:
        checkpoint.prune(args.checkpoint_dir, args.keep_checkpoints, path)


def _finish_checkpoints(
    runner, optim, args: argparse.Namespace, rank: int, tied: dict, start: int, resumed
) -> None:
    """Save after the last step (unless this run saved it or resumed from it), then --export.
    A checkpoint of that step found on disk is not trusted: it may be the damaged one that the
    resume skipped, so it is saved again."""
    from autopart.runtime import checkpoint  # lazy: torch.distributed.checkpoint (~1 s)

    final = checkpoint.folder(args.checkpoint_dir, runner.steps)
    every = args.checkpoint_every
    saved_now = runner.steps > start and every and runner.steps % every == 0
    if not saved_now and final != resumed:
        _save(runner, optim, args, rank, runner.steps, tied)
    if args.export is not None and rank == 0:  # the other ranks wait at run()'s final barrier
        state = checkpoint.export_state_dict(final)
        args.export.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.export)
        print(f"single-device state dict of step {runner.steps}: {args.export}", flush=True)


def _train(
    runner,
    optim,
    batches: Batches,
    args: argparse.Namespace,
    rank: int,
    first: int = 0,
    tied: dict | None = None,
) -> float:
    """Train from step ``first`` to ``args.steps``; returns the last step's seconds."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    show = rank == 0 and not args.json
    with Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        TextColumn("{task.fields[loss]}"),
        TimeElapsedColumn(),
        disable=not show,
    ) as bar:
        task = bar.add_task("train", total=args.steps, completed=min(first, args.steps), loss="")
        seen: list[float] = []
        last_s = 0.0
        for step in range(first, args.steps):
            start = time.perf_counter()
            loss = runner.step(**batch_fields(batches(step)))
            if step == 0 and args.dump is not None:
                dump(runner, loss, args.dump)
            if optim is not None:
                optim.step()
                optim.zero_grad(set_to_none=True)
            else:  # --no-optim: each step's gradients are its own (they added up, with a warning)
                runner.zero_grad(set_to_none=True)
            seconds = last_s = time.perf_counter() - start
            if rank == 0 and args.json:
                print(
                    json.dumps({"step": step, "loss": float(loss), "seconds": round(seconds, 4)}),
                    flush=True,
                )
            elif show:
                bar.console.print(
                    f"step {step:>4}  loss {float(loss):.6f}  ({seconds * 1e3:.0f} ms)"
                )
            bar.update(task, advance=1, loss=f"loss {float(loss):.4f}")
            seen.append(float(loss))
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                _save(runner, optim, args, rank, step + 1, tied or {})
    if show and len(seen) >= 10:  # a mean over 5 steps: one batch's loss is noisy
        early, late = sum(seen[:5]) / 5, sum(seen[-5:]) / 5
        trend = "falling" if late < early else "NOT falling"
        if args.tokens is None and args.batch is None:  # random tokens: nothing to learn
            trend = "random tokens: pass --tokens to train on data"
        print(
            f"loss (mean of 5 steps): {early:.4f} at the start → {late:.4f} at the end ({trend})",
            flush=True,
        )
    return last_s


def _title(plan: Plan, folder: Path) -> str:
    chunks = f", {plan.seq_chunks} sequence chunks" if plan.seq_chunks > 1 else ""
    virtual = f", {plan.virtual_stages} virtual stages" if plan.virtual_stages > 1 else ""
    return (
        f"{folder.name}: {plan.schedule}, {plan.mesh}, {plan.microbatches} micro-batches"
        f"{chunks}{virtual} (last step, measured)"
    )


def _write_trace(
    runner,
    path: Path | None,
    rank: int,
    png: Path | None = None,
    title: str = "",
    header: dict | None = None,
    step_s: float = 0.0,
) -> None:
    """Gather every rank's last step to rank 0: the trace (with the header that
    ``autopart simulate --measured`` reads, see autopart/planning/calibrate.py) and the picture."""
    mine = {
        "rank": rank,
        "events": runner.chrome_trace(),
        "busy_fraction": runner.busy_fraction(),
        "peak_saved_bytes": runner.peak_saved_bytes,
        "coords": runner.program.coords.as_dict(),
        "step_s": step_s,
    }
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        events = [e for r in every for e in r["events"]]
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            header = {
                **(header or {}),
                "step_s": max(r["step_s"] for r in every),
                "ranks": {str(r["rank"]): r["coords"] for r in every},
            }
            path.write_text(json.dumps(trace_document(events, header)))
        for r in every:
            print(
                json.dumps(
                    {
                        "rank": r["rank"],
                        "busy_fraction": round(r["busy_fraction"], 4),
                        "peak_saved_bytes": r["peak_saved_bytes"],
                    }
                ),
                flush=True,
            )
        if path is not None:
            print(f"trace of the last step: {path} (open in https://ui.perfetto.dev)", flush=True)
        if png is not None:
            print(f"timeline of the last step: {plot_timeline(events, png, title)}", flush=True)


if __name__ == "__main__":
    code = main()
    collectives.close()  # os._exit skips atexit: unlink any shared-memory file still linked
    sys.stdout.flush()
    sys.stderr.flush()
    # The groups are already destroyed; skip interpreter teardown, where gloo's threads have been
    # seen to abort ("terminate called without an active exception") after a clean run.
    os._exit(code)
