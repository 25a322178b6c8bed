"""The ranks of ``autopart train`` (``python -m autopart.runtime.train OUT/train.json``, under
torchrun; ``autopart train CONFIG.toml`` prepares OUT and starts it).

Each rank loads its program from ``OUT/program`` (compiled once, by the launcher), the token
ids from ``OUT/tokens.pt`` and the checked configuration from ``OUT/train.json``, then trains:

1. **Data.** Step ``k`` trains on ``batch_size`` windows of ``seq_len + 1`` tokens drawn from
   the training part of the ids by a generator seeded with (seed, k); the validation part (the
   last ``val_fraction``) is never trained on. The data position is the step, so a resumed run
   sees what the uninterrupted one would have.
2. **Optimizer.** AdamW over the rank's shards, weight decay on matrices only (parameters of two
   or more dims), the learning rate warmed up linearly, then cosine down to ``min_lr``
   (``train_config.lr_factor``, a ``LambdaLR``).
3. **A step.** ``Runner.step``, then ``clip_grad_norm_`` (the global norm: the same on every
   rank), the optimizer, the scheduler. Every ``eval.every`` steps, ``eval.batches`` batches of
   the validation part in eval mode (forward only, no dropout).
4. **Checkpoints** every ``checkpoint.every`` steps and after the last: the model, AdamW's state,
   the scheduler, the data position and the generators (``runtime/checkpoint.py``); the newest
   ``keep`` are kept. A run resumes from the newest intact one in the folder.
5. **Metrics.** Rank 0 writes one JSON line per logged step to ``OUT/metrics.jsonl`` (loss, grad
   norm, learning rate, tokens/s, seconds, MFU when ``peak_tflops`` is set; ``val_loss`` on eval
   steps), to TensorBoard when asked and installed, and shows a progress bar.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopart import collectives
from autopart.errors import AutopartError
from autopart.layout import Plan
from autopart.program.format import load_rank, load_weights, read_head
from autopart.runtime import checkpoint, dirlock
from autopart.runtime.launch import rank_setup
from autopart.runtime.placement import backend_for, pick_device
from autopart.runtime.runner import Runner, join_torchrun, make_groups
from autopart.runtime.train_config import TrainConfig, lr_factor

MANIFEST = "train.json"  # in OUT: the config, the token split and the FLOPs per token


def windows(ids: torch.Tensor, rows: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` windows of ``seq + 1`` ids drawn by a generator seeded with ``seed``: the inputs
    and the next-token labels."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq - 1, (rows,), generator=g)
    batch = torch.stack([ids[i : i + seq + 1] for i in starts.tolist()])
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def optimizer(runner: Any, cfg: TrainConfig) -> tuple[Any, Any]:
    """AdamW with decay on matrices only, and its warmup-cosine ``LambdaLR``."""
    named = list(runner.named_parameters())
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": cfg.optim_weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.optim_lr,
        betas=(cfg.optim_beta1, cfg.optim_beta2),
        eps=cfg.optim_eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))
    return opt, sched


class Metrics:
    """Rank 0's metrics: JSON lines, TensorBoard when asked and installed. A run resumed at
    step ``start`` first drops what an earlier run logged after that step (it is trained
    again), so each step is logged once."""

    def __init__(self, cfg: TrainConfig, rank: int, start: int = 0) -> None:
        self.on = rank == 0
        self.file = None
        self.board = None
        if not self.on:
            return
        path = cfg.out_dir / cfg.log_jsonl if cfg.log_jsonl else None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            _drop_rows_after(path, start)
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if cfg.log_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("autopart train: tensorboard is not installed; JSON lines only", flush=True)
            else:
                # purge_step: events of the steps trained again are dropped from the view
                self.board = SummaryWriter(str(cfg.out_dir / "tensorboard"), purge_step=start + 1)

    def write(self, row: dict[str, Any]) -> None:
        if not self.on:
            return
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
        if self.board is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.board.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite the JSON lines at ``path`` without the rows of steps after ``step`` (a line that
    is not a row with a step is kept as it is)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)

    def later(line: str) -> bool:
        try:
            row = json.loads(line)
        except ValueError:
            return False
        return isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step

    kept = [line for line in lines if not later(line)]
    if len(kept) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print(
            "usage: python -m autopart.runtime.train OUT/train.json (under torchrun)",
            file=sys.stderr,
        )
        return 2
    try:
        return train(Path(args[0]))
    except AutopartError as exc:
        print(f"autopart train: error: {exc}", file=sys.stderr, flush=True)
        return 2


def train(manifest: Path) -> int:
    if "RANK" in os.environ:
        rank_setup(collectives.close)
    doc = json.loads(manifest.read_text())
    cfg = TrainConfig.from_json(doc["config"])
    folder = cfg.out_dir / "program"
    head = read_head(folder)
    plan = Plan.from_json(head["plan"])
    device = pick_device(cfg.train_device or None)
    rank, world = join_torchrun(cfg.train_timeout, backend_for(device))
    torch.manual_seed((cfg.train_seed * 1_000_003 + rank) % 2**63)
    # rank 0 holds the checkpoint folder until the process ends (another run there is refused)
    held = dirlock.claim(cfg.checkpoints) if rank == 0 else None
    plan.mesh.check_world(world)
    program = load_rank(folder, rank, cfg.parallel_library_ops, head)  # plan.json read once
    runner = Runner(
        program,
        plan,
        load_weights(folder, rank, program, head),
        make_groups(plan, rank, head.get("ties", program.ties)),
        timeout_s=cfg.train_timeout,
        seed=cfg.train_seed,
        compile=cfg.parallel_compile,
        device=device,
    )
    runner.tied = dict(head["tied"])
    ids = torch.load(cfg.out_dir / "tokens.pt", weights_only=True)
    split = int(doc["train_tokens"])
    train_ids, val_ids = ids[:split], ids[split:]
    opt, sched = optimizer(runner, cfg)
    start = _resume(runner, opt, sched, cfg, rank)
    metrics = Metrics(cfg, rank, start)
    try:
        _loop(runner, opt, sched, cfg, rank, start, train_ids, val_ids, doc, metrics, head)
    finally:
        metrics.close()
    dist.barrier()
    dist.destroy_process_group()
    if held is not None:
        held.close()
    return 0


def _loop(
    runner: Any,
    opt: Any,
    sched: Any,
    cfg: TrainConfig,
    rank: int,
    start: int,
    train_ids: torch.Tensor,
    val_ids: torch.Tensor,
    doc: dict[str, Any],
    metrics: Metrics,
    head: dict[str, Any],
) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    tokens = cfg.data_batch_size * cfg.data_seq_len
    flops = float(doc["flops_per_token"]) * tokens
    with Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        disable=rank != 0,
    ) as bar:
        task = bar.add_task("train", total=cfg.train_steps, completed=start, info="")
        for step in range(start, cfg.train_steps):
            t0 = time.perf_counter()
            x, y = windows(
                train_ids, cfg.data_batch_size, cfg.data_seq_len, cfg.train_seed * 1_000_003 + step
            )
            loss = runner.step(x, y, shifted=True)
            if cfg.optim_max_grad_norm > 0:
                norm = runner.clip_grad_norm_(cfg.optim_max_grad_norm)
            else:
                norm = runner.grad_norm()
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - t0
            row: dict[str, Any] = {
                "step": step + 1,
                "loss": float(loss),
                "grad_norm": norm,
                "lr": lr,
                "tokens_per_s": tokens / seconds,
                "seconds": seconds,
            }
            if cfg.log_peak_tflops > 0:
                world = dist.get_world_size()
                row["mfu"] = flops / seconds / (world * cfg.log_peak_tflops * 1e12)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                row["val_loss"] = _validate(runner, cfg, val_ids, step + 1)
            if (step + 1) % cfg.log_every == 0 or "val_loss" in row:
                metrics.write(row)
            info = f"loss {row['loss']:.4f}  {row['tokens_per_s']:,.0f} tok/s"
            if "val_loss" in row and rank == 0:
                bar.console.print(f"step {step + 1}: val_loss {row['val_loss']:.4f}")
            bar.update(task, advance=1, info=info)
            last = step + 1 == cfg.train_steps
            if (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or last:
                _save(runner, opt, sched, cfg, rank, step + 1, head["tied"])


def _validate(runner: Any, cfg: TrainConfig, val_ids: torch.Tensor, step: int) -> float:
    """The mean loss over ``eval.batches`` validation batches, in eval mode, forward only."""
    runner.eval()
    try:
        total = 0.0
        for i in range(cfg.eval_batches):
            x, y = windows(val_ids, cfg.data_batch_size, cfg.data_seq_len, -(i + 1))
            total += float(runner.evaluate(x, y, shifted=True))
    finally:
        runner.train()
    return total / cfg.eval_batches


def _resume(runner: Any, opt: Any, sched: Any, cfg: TrainConfig, rank: int) -> int:
    """Load the newest intact checkpoint (a damaged newer one is named and skipped)."""
    if not cfg.checkpoints.exists():
        return 0

    def skipped(line: str) -> None:
        if rank == 0:
            print(f"autopart train: {line}", file=sys.stderr, flush=True)

    found = checkpoint.latest(cfg.checkpoints, runner, on_skip=skipped)
    if found is None:
        return 0
    # the TOML's settings are this run's own; the rate is the scheduler's, set below
    info = checkpoint.load(found, runner, opt, hyperparameters=False)
    extra = info.get("extra") or {}
    if extra.get("seed") != cfg.train_seed:
        raise AutopartError(
            f"{found} was trained with seed {extra.get('seed')}, not {cfg.train_seed}",
            hint="use the same [train] seed, or a fresh checkpoint folder",
        )
    sched.load_state_dict(extra["scheduler"])
    for group, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
        group["lr"] = lr  # a scheduler's state holds the rate; the optimizer's groups use it
    if rank == 0:
        print(f"resumed from step {info['step']}: {found}", flush=True)
    return int(info["step"])


def _save(
    runner: Any, opt: Any, sched: Any, cfg: TrainConfig, rank: int, step: int, tied: dict
) -> None:
    state = sched.state_dict()  # JSON: lr_lambdas holds None for a plain function
    path = checkpoint.save(
        checkpoint.folder(cfg.checkpoints, step),
        runner,
        opt,
        step,
        {"seed": cfg.train_seed, "scheduler": state},
        tied=tied,
    )
    if rank == 0 and cfg.checkpoint_keep:
        checkpoint.prune(cfg.checkpoints, cfg.checkpoint_keep, path)


if __name__ == "__main__":
    code = main()
    collectives.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
