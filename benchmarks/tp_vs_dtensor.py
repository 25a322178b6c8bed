"""Tensor parallelism on CPU: autopart tp=2 against hand-written DTensor tp=2 and one process.

Model: the nanoGPT-style GPT of ``examples/nanogpt.py`` (4 blocks, 8 heads, vocabulary 1024,
float32, no dropout) at three sizes in one run, from dispatch-bound to matmul-bound: width 64
with a batch of 2 × 32 tokens, 128 with 4 × 64, 256 with 8 × 128 (``SIZES``). The same seeded
weights and batch for all three runs of a size. One step is forward + backward (no optimizer),
timed as

1. single process, 1 thread: ``logits = model(x)``, cross entropy (ignore_index=-100), backward;
2. autopart tp=2: ``autopart.parallelize(model, mesh, ...).step(x, y)`` on the unmodified model
   (its tp collectives go through shared memory; ``AUTOPART_SHM=0`` measures the socket path);
3. DTensor tp=2: ``parallelize_module`` with ColwiseParallel on ``attn.c_attn`` / ``mlp.c_fc`` and
   RowwiseParallel on ``attn.c_proj`` / ``mlp.c_proj`` in every block, inputs replicated.

(2) and (3) run under torchrun on 2 gloo ranks with OMP_NUM_THREADS=1 each, launched by this
script itself; their steps alternate so that background load hits both alike. Each is warmed up
for 3 steps, then 10 steps are timed (per step, the slower rank counts) and the median reported.
Per size it prints the three step times, autopart / DTensor (goal <= 0.8) and autopart / single
process. The step-0 losses must agree (1e-4 relative) or the script exits 1; it exits 0
otherwise.

DTensor needed model edits that autopart did not (see ``dtensor_model``): nanoGPT's attention
takes the head width from the input's full width, and the fused q|k|v rows of ``c_attn`` are cut
by Colwise into [q, half of k] | [other half of k, v], not per-head q|k|v. Setting
``n_head //= 2`` and ``n_embd //= 2`` alone fails; we also reorder c_attn's rows per rank and use a
forward that reads the local width from ``n_embd`` (what Megatron/torchtitan attention does).

    python benchmarks/tp_vs_dtensor.py                                 # the three sizes
    python benchmarks/tp_vs_dtensor.py --width 256 --seq 128 --batch 8  # one size
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import record, run_workers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from nanogpt import GPT, GPTConfig, batch  # noqa: E402

WARMUP, ITERS, TP, RTOL = 3, 10, 2, 1e-4
CFG, BATCH, SEQ = None, 8, 128  # set by configure(): the defaults are 4 x 256, batch 8 x 128


def configure(width: int = 256, seq: int = 128, batch_size: int = 8) -> None:
    """The model and batch of this run (``--width/--seq/--batch``; the workers get the same)."""
    global CFG, BATCH, SEQ
    CFG = GPTConfig(n_layer=4, n_embd=width, n_head=8, vocab_size=1024, block_size=seq, dropout=0.0)
    BATCH, SEQ = batch_size, seq


configure()


def build() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return GPT(CFG), batch(CFG, BATCH, SEQ, seed=0)


def torch_step(model, x, y) -> torch.Tensor:
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100)
    loss.backward()
    return loss.detach()


def bench(runs: dict, sync=lambda: None) -> dict[str, tuple[float, list[float]]]:
    """``runs``: name -> (step, params). Steps of the runs alternate, so that background load
    hits them alike, and their order flips every iteration (the second of two back-to-back
    runs measured ~10 ms faster here whichever it was). Returns name -> (step-0 loss, times in
    s of ITERS steps after WARMUP)."""
    out = {name: (None, []) for name in runs}
    for i in range(WARMUP + ITERS):
        for name, (step, params) in list(runs.items())[:: -1 if i % 2 else 1]:
            for p in params:
                p.grad = None
            sync()
            start = time.perf_counter()
            loss = step()
            sync()
            elapsed = time.perf_counter() - start
            if i == 0:
                out[name] = (loss.item(), out[name][1])
            if i >= WARMUP:
                out[name][1].append(elapsed)
    return out


def _local_attention(self, x: torch.Tensor) -> torch.Tensor:
    """nanoGPT's attention with the local width (``self.n_embd``) instead of ``x.size(-1)``."""
    B, T, _ = x.size()
    C, hs = self.n_embd, self.n_embd // self.n_head
    q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def dtensor_model(mesh, x: torch.Tensor) -> tuple[GPT, str]:
    """The DTensor tp model, and what the stock forward did with only n_head/n_embd halved."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model, _ = build()
    C, s = CFG.n_embd, CFG.n_embd // TP
    # rank r's contiguous Colwise shard of c_attn must be [q_r | k_r | v_r] (its own heads)
    rows = torch.cat(
        [torch.arange(j * C + r * s, j * C + (r + 1) * s) for r in range(TP) for j in range(3)]
    )
    plan = {
        "attn.c_attn": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    for block in model.transformer.h:
        with torch.no_grad():
            for t in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                t.copy_(t[rows])
        parallelize_module(block, mesh, plan)
        block.attn.n_head //= TP
        block.attn.n_embd //= TP
    try:  # the attribute edit alone, with the stock forward
        with torch.no_grad():
            model(x)
        stock = "ran (unexpected)"
    except RuntimeError as exc:
        stock = f"fails: {str(exc).splitlines()[0][:90]}"
    for block in model.transformer.h:
        block.attn.forward = types.MethodType(_local_attention, block.attn)
    return model, stock


def worker(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopart

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    model, (x, y) = build()
    runner = autopart.parallelize(model, mesh, example_inputs=(x, y), microbatches=1)
    dt, stock = dtensor_model(mesh, x)
    runs = {
        "autopart": (lambda: runner.step(x, y), list(runner.parameters())),
        "dtensor": (lambda: torch_step(dt, x, y), list(dt.parameters())),
    }
    res = bench(runs, dist.barrier)
    for name, (loss0, times) in res.items():  # per step, the slower rank's time
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res[name] = (loss0, t.tolist())
    if dist.get_rank() == 0:
        res["stock_forward"] = stock
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


SIZES = ((64, 32, 2), (128, 64, 4), (256, 128, 8))  # (width, seq, batch): dispatch → compute bound


def measure_size(width: int, seq: int, batch_size: int) -> dict | None:
    """One size: the single process here, both tp runs on 2 torchrun ranks. Returns name →
    (step-0 loss, step times), or None when the ranks failed."""
    configure(width, seq, batch_size)
    model, (x, y) = build()
    results = bench({"single": (lambda: torch_step(model, x, y), list(model.parameters()))})
    ranks = run_workers(
        __file__, TP, "--width", str(width), "--seq", str(seq), "--batch", str(batch_size)
    )
    if ranks is None:
        return None
    results.update(ranks)
    results["params"] = sum(p.numel() for p in model.parameters())
    return results


def main(sizes: tuple[tuple[int, int, int], ...] = SIZES) -> int:
    torch.set_num_threads(1)
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 1 thread/rank")
    print(
        "model: nanoGPT 4 blocks, 8 heads, V=1024, float32; forward + backward, "
        f"median of {ITERS} steps after {WARMUP} warm-up; autopart and DTensor alternate"
    )
    print(
        f"{'width':>5} {'batch':>9} {'params':>8} {'single':>9} {'autopart':>9} {'DTensor':>9}"
        f" {'ap/DTensor':>10} {'ap/single':>9}  goal <= 0.8"
    )
    bad, stock, missed = [], "", []
    for width, seq, batch_size in sizes:
        results = measure_size(width, seq, batch_size)
        if results is None:
            return 2
        params = results.pop("params")
        stock = results.pop("stock_forward")
        ms = {k: 1e3 * statistics.median(t) for k, (_, t) in results.items()}
        loss = {k: v[0] for k, v in results.items()}
        ratio = ms["autopart"] / ms["dtensor"]
        if ratio > 0.8:
            missed.append(width)
        print(
            f"{width:>5} {f'{batch_size} x {seq}':>9} {params / 1e6:>7.2f}M {ms['single']:>7.1f}ms "
            f"{ms['autopart']:>7.1f}ms {ms['dtensor']:>7.1f}ms {ratio:>10.3f} "
            f"{ms['autopart'] / ms['single']:>9.3f}  {'met' if ratio <= 0.8 else 'MISSED'}",
            flush=True,
        )
        record(
            "tp_vs_dtensor",
            f"tp=2 step, width {width}, {batch_size}x{seq}",
            ms["autopart"],
            ms["dtensor"],
            "DTensor tp=2 (hand plan)",
            "<= 0.8",
            ratio <= 0.8,
            "ms",
        )
        bad += [
            f"width {width}: {k}"
            for k in ("autopart", "dtensor")
            if abs(loss[k] - loss["single"]) > RTOL * abs(loss["single"])
        ]
    print(
        "model edits: autopart none; DTensor needed c_attn rows reordered per rank, "
        "attn.n_head //= 2, attn.n_embd //= 2 and a forward using the local width"
    )
    print(f"  (with n_head/n_embd halved but nanoGPT's own forward, DTensor {stock})")
    if missed:
        print(
            f"goal missed at width {', '.join(map(str, missed))}: there the step is bound by "
            "matmuls and collective latency (docs/tensor_parallel.md)"
        )
    if bad:
        print(
            f"LOSS MISMATCH at step 0 against the single process: {'; '.join(bad)}", file=sys.stderr
        )
        return 1
    print(f"losses agree at step 0 (relative tolerance {RTOL:g})")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="RESULT_JSON", help="internal: run as a torchrun rank")
    ap.add_argument("--width", type=int, help="one size only: model width (8 heads)")
    ap.add_argument("--seq", type=int, default=128, help="with --width: sequence length (128)")
    ap.add_argument("--batch", type=int, default=8, help="with --width: sequences per step (8)")
    args = ap.parse_args()
    if args.worker:
        configure(args.width, args.seq, args.batch)
        worker(args.worker)
    else:
        sys.exit(main(((args.width, args.seq, args.batch),) if args.width else SIZES))
