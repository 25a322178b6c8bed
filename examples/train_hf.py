"""A training loop around ``autopart.parallelize``, written as a DDP/FSDP user would write it.

Run with torchrun (CPU, gloo; 4 ranks = tp2 x pp2 by default)::

    torchrun --nproc-per-node 4 examples/train_hf.py --tp 2 --pp 2 --steps 20 --out /tmp/run

It builds a small Hugging Face Llama from a random config (nothing is downloaded), parallelizes
it on a live ``DeviceMesh``, and trains on a text file (default: the corpus shipped with
autopart), with what an ordinary loop has: AdamW with weight decay on matrices only, linear
warmup then cosine decay, global-norm gradient clipping, gradient accumulation over
``--accumulate`` micro-steps (``no_sync``: one dp reduction per optimizer step, token-weighted),
each rank loading only its data-parallel share of the batch, validation in eval mode every
``--eval-every`` steps, checkpoints (optimizer, scheduler, data position) every
``--save-every`` steps with resume from the newest intact one, and at the end the trained
weights copied back into the user's module and saved with ``save_pretrained``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopart
from autopart import checkpoint


def build_model(vocab: int, seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=seq,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)  # each rank's own random init: parallelize takes rank 0's


def tokens(path: Path) -> torch.Tensor:
    """Byte-level tokens of a text file (vocabulary 256)."""
    return torch.tensor(list(path.read_bytes()), dtype=torch.int64)


def batch_at(ids: torch.Tensor, step: int, rows: int, seq: int, share: tuple[int, int]):
    """Global batch number ``step`` of ``rows`` windows; this rank's dp share of it only.
    Labels as Hugging Face takes them: ``labels = input_ids`` (the model shifts them)."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(ids) - seq, (rows,), generator=g)
    index, size = share
    mine = starts.view(size, -1)[index]  # rows are dealt to dp replicas in order
    x = torch.stack([ids[s : s + seq] for s in mine.tolist()])
    return x, x.clone()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows) per micro-step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--text", type=Path, default=None, help="training text (default: the corpus)")
    p.add_argument("--out", type=Path, default=Path("train_hf_out"))
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // (args.tp * args.pp)
    mesh = init_device_mesh("cpu", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    text = args.text or Path(autopart.__file__).parent / "models" / "data" / "corpus.txt"
    ids = tokens(text)
    split = int(0.9 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]

    model = build_model(256, args.seq)
    example = batch_at(train_ids, 0, args.batch, args.seq, (0, 1))
    runner = autopart.parallelize(model, mesh, example, microbatches=args.microbatches)
    share = (runner.dp_rank, runner.dp_size)

    named = list(runner.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [t for _, t in named if t.dim() >= 2], "weight_decay": 0.1},
            {"params": [t for _, t in named if t.dim() < 2], "weight_decay": 0.0},
        ],
        lr=args.lr,
    )

    def schedule(step: int) -> float:  # linear warmup, then cosine to 10 %
        if step < args.warmup:
            return (step + 1) / args.warmup
        done = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ck = args.out / "checkpoints"
    start = 0
    if (found := checkpoint.latest(ck, runner)) is not None:
        info = checkpoint.load(found, runner, opt)
        start = info["step"]
        sched.load_state_dict(info["extra"]["scheduler"])
        if rank == 0:
            print(f"resumed from {found} at step {start}", flush=True)

    tied = checkpoint.tied_names(model)
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        micro = [
            batch_at(train_ids, step * args.accumulate + k, args.batch, args.seq, share)
            for k in range(args.accumulate)
        ]
        # the loss is the mean over every label of every micro-step's global batch (HF shifts:
        # labels[:, 1:] count); with local shares, each rank counts the whole batch itself
        count = sum(
            int(
                (batch_at(train_ids, step * args.accumulate + k, args.batch, args.seq, (0, 1))[1])[
                    :, 1:
                ]
                .ne(-100)
                .sum()
            )
            for k in range(args.accumulate)
        )
        total = 0.0
        for k, (x, y) in enumerate(micro):
            last = k == len(micro) - 1
            with contextlib.nullcontext() if last else runner.no_sync():
                total += float(runner.step(x, y, local=True, num_tokens=count))
        norm = runner.clip_grad_norm_(args.clip)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            took = time.perf_counter() - t0
            rate = args.batch * args.accumulate * args.seq / took
            print(
                f"step {step + 1:4d}  loss {total:.4f}  grad norm {norm:.3f}  "
                f"lr {lr:.2e}  {rate:,.0f} tokens/s",
                flush=True,
            )
        if (step + 1) % args.eval_every == 0:
            runner.eval()
            x, y = batch_at(val_ids, 10_000 + step, args.batch, args.seq, (0, 1))
            val = float(runner.evaluate(x, y))
            runner.train()
            if rank == 0:
                print(f"step {step + 1:4d}  val loss {val:.4f}", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            extra = {"scheduler": sched.state_dict()}
            checkpoint.save(
                checkpoint.folder(ck, step + 1), runner, opt, step=step + 1, extra=extra, tied=tied
            )

    runner.copy_to(model)  # the user's module now holds the trained weights
    if rank == 0:
        model.save_pretrained(args.out / "model")
        print(f"saved {args.out / 'model'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
