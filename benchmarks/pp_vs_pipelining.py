"""Pipeline parallelism on CPU: autopart 1F1B against torch.distributed.pipelining 1F1B, pp=2.

Model: HF ``GPT2LMHeadModel`` from a small random config (4 blocks, width 256, 8 heads, vocabulary
1024, no dropout, tied ``wte``/``lm_head``, float32; no download); the same seeded weights and one
batch of 8 x 128 random tokens, next-token labels (none ignored), 4 micro-batches. One step is
forward + backward, no optimizer, on 2 gloo ranks (torchrun, launched here, OMP_NUM_THREADS=1):

1. autopart: ``parallelize(model, mesh, schedule="1f1b", microbatches=4).step(x, y)`` on the
   unmodified model, with autopart's own cost-balanced split;
2. torch: ``pipeline(model, split_spec={"transformer.h.2": SplitPoint.BEGINNING})`` (hand-placed
   middle block), ``build_stage``, ``Schedule1F1B``, loss_fn = mean CE of the micro-batch. If the
   tracer fails on HF GPT-2 this is printed and the manual ``PipelineStage`` API (``Half``) is used
   (``--manual`` forces it). The tracer unties ``wte``/``lm_head``, so the torch step all-reduces
   that gradient and the loss, as autopart's runtime does.

Steps alternate, each after a barrier; median of 10 after 3 warm-up (per step, the slower rank);
ratio autopart / torch (goal <= 1.0). autopart's loss (mean over all labels of the global batch)
equals the mean of torch's micro-batch means here; step-0 losses must agree to 1e-4 (relative) or
the script exits 1 (2 if a rank fails, else 0). Peak saved-activation bytes: autopart's
``runner.peak_saved_bytes``; for torch, one extra untimed step under ``LiveSaved``, the same
``saved_tensors_hooks`` rule (numel x element size per saved tensor, parameters excluded, views
not de-duplicated), each saved tensor wrapped in a ``Box`` whose ``weakref.finalize`` subtracts its
bytes when autograd frees it; the peak of that running sum is reported. (autopart's runtime
always counts with such hooks, in its timed steps too; torch's timed steps run without.)

    python benchmarks/pp_vs_pipelining.py [--manual]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import record, run_workers  # noqa: E402
from _torchpp import GPT2, TIED, LiveSaved, gpt2, torch_1f1b, torch_stage  # noqa: E402

BATCH, SEQ, M, P, WARMUP, ITERS, RTOL = 8, 128, 4, 2, 3, 10, 1e-4
SPLIT = "transformer.h.2"


def build() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return gpt2(SEQ, BATCH, positions=256)


def worker(out: str, manual: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopart

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("pp",))
    rank = dist.get_rank()
    model, (x, y) = build()
    runner = autopart.parallelize(
        model, mesh, example_inputs=(x, y), schedule="1f1b", microbatches=M
    )
    stage, how = torch_stage(build()[0], rank, x[: BATCH // M], mesh.get_group("pp"), manual, SPLIT)
    torch_step, tparams = torch_1f1b(stage, M, rank, x, y)

    runs = {
        "autopart": (lambda: runner.step(x, y, shifted=True), dict(runner.named_parameters())),
        "torch": (torch_step, tparams),
    }
    loss0, grads0, times = {}, {}, {k: [] for k in runs}
    for i in range(WARMUP + ITERS):
        for name, (step, params) in runs.items():
            for p in params.values():
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            loss = step()
            elapsed = time.perf_counter() - start
            if i == 0:
                loss0[name] = loss.item()
                grads0[name] = {
                    TIED[0] if n == TIED[1] else n: p.grad.clone()
                    for n, p in params.items()
                    if p.grad is not None
                }
            if i >= WARMUP:
                times[name].append(elapsed)
    saved = LiveSaved(tparams.values())  # one more torch step (grads accumulate: no matter)
    with saved.hooks:
        torch_step()
    common = sorted(set(grads0["autopart"]) & set(grads0["torch"]))
    gerr = max(
        (grads0["autopart"][n] - grads0["torch"][n]).norm().item()
        / grads0["torch"][n].norm().clamp(min=1e-30).item()
        for n in common
    )
    t = torch.tensor(list(times.values()), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step, the slower rank's time
    blocks = sorted({int(n.split(".")[2]) for n, _ in runner.named_parameters() if ".h." in n})
    mine = {
        "rank": rank,
        "how": how,
        "loss0": loss0,
        "grad_err": gerr,
        "n_common": len(common),
        "saved": {"autopart": runner.peak_saved_bytes, "torch": saved.peak},
        "blocks": blocks,
        "times": t.tolist(),
    }
    every = [None] * P
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()


def main(manual: bool) -> int:
    ranks = run_workers(__file__, P, *(["--manual"] if manual else []))
    if ranks is None:
        return 2
    params = sum(p.numel() for p in build()[0].parameters())
    ms = [1e3 * statistics.median(t) for t in ranks[0]["times"]]
    loss = ranks[-1]["loss0"]
    blocks = ", ".join(f"rank {r['rank']} blocks {r['blocks']}" for r in ranks)
    print(
        f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 1 thread/rank "
        "(the cores may be shared with other processes: expect noise)"
    )
    print(
        f"model: HF GPT2LMHeadModel {GPT2['n_layer']} x {GPT2['n_embd']}, {GPT2['n_head']} "
        f"heads, V={GPT2['vocab_size']}, {params / 1e6:.2f} M params, float32; batch {BATCH} x "
        f"{SEQ} in {M} micro-batches, pp={P}, 1F1B"
    )
    print(f"torch.distributed.pipelining: {ranks[0]['how']}")
    print(f"autopart: automatic split: {blocks}")
    print(
        f"timing: median of {ITERS} steps after {WARMUP} warm-up (forward + backward, no "
        "optimizer; per step the slower rank)"
    )
    for name, t in zip(("autopart 1F1B", "torch Schedule1F1B"), ms, strict=True):
        print(f"  {name:<20} {t:8.1f} ms/step   step-0 loss {loss[name.split()[0]]:.6f}")
    ratio = ms[0] / ms[1]
    record(
        "pp_vs_pipelining",
        "pp=2 1F1B step time",
        ms[0],
        ms[1],
        "torch.distributed.pipelining Schedule1F1B",
        "<= 1.0",
        ratio <= 1.0,
        "ms",
    )
    print(f"autopart / torch: {ratio:.3f}  (goal <= 1.0: {'met' if ratio <= 1.0 else 'MISSED'})")
    print("peak saved-activation bytes (saved_tensors_hooks, parameters excluded); step-0 grads:")
    for r in ranks:
        a, t = r["saved"]["autopart"], r["saved"]["torch"]
        print(
            f"  rank {r['rank']}: autopart {a / 2**20:6.2f} MiB, torch {t / 2**20:6.2f} MiB "
            f"(ratio {a / max(t, 1):.3f}); gradients of {r['n_common']} common parameters: "
            f"max relative difference {r['grad_err']:.1e}"
        )
    if abs(loss["autopart"] - loss["torch"]) > RTOL * abs(loss["torch"]):
        print("LOSS MISMATCH at step 0: autopart vs torch", file=sys.stderr)
        return 1
    print(f"losses agree at step 0 (relative tolerance {RTOL:g})")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="RESULT_JSON", help="internal: run as a torchrun rank")
    ap.add_argument("--manual", action="store_true", help="use the manual PipelineStage API")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.manual)
        sys.stdout.flush()
        os._exit(
            0
        )  # skip interpreter teardown, where gloo threads can abort (see autopart/runtime/run.py)
    else:
        sys.exit(main(args.manual))
