"""Seq1F1B on CPU: activation memory and step time against 1F1B (autopart's and torch's), pp=2.

Model: HF ``GPT2LMHeadModel`` from a small random config (4 blocks, width 256, 8 heads,
vocabulary 1024, no dropout, tied ``wte``/``lm_head``, float32; no download); the same seeded
weights and one batch of 8 × 1024 random tokens (a long sequence for the model's size), 8
micro-batches of one sequence each. One step is forward + backward, no optimizer, on 2 gloo
ranks (torchrun, launched here, OMP_NUM_THREADS=1). Three programs on the same model and batch:

1. autopart ``schedule="1f1b"``;
2. autopart ``schedule="seq1f1b", seq_chunks=4`` three times: chunks ``balanced`` by FLOPs,
   ``measured`` (balanced by the forward times the first 3 steps measure) and ``uniform``;
3. torch.distributed.pipelining ``Schedule1F1B`` (``pipeline()`` split at ``transformer.h.2``,
   or the manual ``PipelineStage`` API if the tracer fails; see ``_torchpp.py``).

Memory: peak bytes autograd holds for backward on each rank (``saved_tensors_hooks``,
parameters excluded): autopart's ``runner.peak_saved_bytes``; torch's by ``LiveSaved`` in one
extra untimed step. Goal: Seq1F1B ≤ 0.70 × 1F1B on stage 0; theory (p + k − 1)/(k·p) = 0.625
for equal chunks (stage 0 holds p + k − 1 chunks at its peak instead of p micro-batches).
Time: median of 5 steps after 2 warm-up, programs alternating, each after a barrier (per step
the slower rank). Chunk balance: each chunk's forward time per stage (median over the timed
steps' micro-batches) and the max/min over the chunks of a stage; goal (issue 19): within 10 %
on every stage, and balanced chunks at least as fast as uniform ones. Step-0 losses must agree
to 1e-4 (relative) or the script exits 1.

    python benchmarks/seq1f1b.py [--seq 1024] [--microbatches 8]
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
from _launch import losses_agree, record, run_workers  # noqa: E402
from _torchpp import GPT2, LiveSaved, gpt2, torch_1f1b, torch_stage  # noqa: E402

BATCH, P, K, WARMUP, ITERS, RTOL = 8, 2, 4, 2, 5, 1e-4
SPLIT = "transformer.h.2"


def build(seq: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return gpt2(seq, BATCH)


SPLITS = ("balanced", "measured", "uniform")


def worker(out: str, seq: int, m: int, manual: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopart

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("pp",))
    rank = dist.get_rank()
    model, (x, y) = build(seq)
    one = autopart.parallelize(model, mesh, example_inputs=(x, y), schedule="1f1b", microbatches=m)
    seqs = {
        split: autopart.parallelize(
            model,
            mesh,
            example_inputs=(x, y),
            schedule="seq1f1b",
            microbatches=m,
            seq_chunks=K,
            seq_split=split,
        )
        for split in SPLITS
    }
    stage, how = torch_stage(
        build(seq)[0], rank, x[: BATCH // m], mesh.get_group("pp"), manual, SPLIT
    )
    torch_step, tparams = torch_1f1b(stage, m, rank, x, y)

    runs = {"autopart 1F1B": (one.step, list(one.parameters()))}
    for split, r in seqs.items():
        runs[f"Seq1F1B k={K} {split}"] = (r.step, list(r.parameters()))
    runs["torch Schedule1F1B"] = (lambda x, y: torch_step(), list(tparams.values()))
    loss0, times = {}, {k: [] for k in runs}
    chunk_ms: dict[str, dict[str, list[float]]] = {s: {} for s in SPLITS}  # "stage chunk" → ms
    for i in range(WARMUP + ITERS):
        for name, (step, params) in runs.items():
            for p in params:
                p.grad = None
            split = name.split()[-1]
            if i >= WARMUP and split in seqs:
                seqs[split].timeline = []
            dist.barrier()
            start = time.perf_counter()
            loss = step(x, y)
            elapsed = time.perf_counter() - start
            if i == 0:
                loss0[name] = loss.item()
            if i >= WARMUP:
                times[name].append(elapsed)
                if split in seqs:
                    for ev in seqs[split].timeline:
                        if ev.action.kind in ("F", "B"):
                            key = f"{ev.action.kind} {ev.action.stage} {ev.action.chunk}"
                            chunk_ms[split].setdefault(key, []).append(1e3 * (ev.end - ev.start))
                    seqs[split].timeline = None
    saved = LiveSaved(tparams.values())
    with saved.hooks:
        torch_step()
    t = torch.tensor(list(times.values()), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    mine = {
        "rank": rank,
        "how": how,
        "loss0": loss0,
        "times": t.tolist(),
        "saved": [one.peak_saved_bytes, *(r.peak_saved_bytes for r in seqs.values()), saved.peak],
        "chunks": {s: [e - a for a, e in r._chunk_bounds(seq)] for s, r in seqs.items()},
        "chunk_ms": {
            s: {key: statistics.median(v) for key, v in per.items()} for s, per in chunk_ms.items()
        },
        "blocks": sorted({int(n.split(".")[2]) for n, _ in one.named_parameters() if ".h." in n}),
    }
    every = [None] * P
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()


def main(a: argparse.Namespace) -> int:
    ranks = run_workers(
        __file__,
        P,
        "--seq",
        str(a.seq),
        "--microbatches",
        str(a.microbatches),
        *(["--manual"] if a.manual else []),
    )
    if ranks is None:
        return 2
    names = list(ranks[0]["loss0"])  # 1F1B, Seq1F1B balanced / measured / uniform, torch
    ms = [1e3 * statistics.median(t) for t in ranks[0]["times"]]
    params = sum(p.numel() for p in build(a.seq)[0].parameters())
    print(
        f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 1 thread/rank "
        "(the cores may be shared with other processes: expect noise)"
    )
    print(
        f"model: HF GPT2LMHeadModel {GPT2['n_layer']} x {GPT2['n_embd']}, {GPT2['n_head']} heads, "
        f"V={GPT2['vocab_size']}, {params / 1e6:.2f} M params, float32; batch {BATCH} x {a.seq} "
        f"in {a.microbatches} micro-batches, pp={P}"
    )
    print("autopart split: " + ", ".join(f"rank {r['rank']} blocks {r['blocks']}" for r in ranks))
    print(f"torch.distributed.pipelining: {ranks[0]['how']}")

    print(f"\nSeq1F1B chunk balance: forward ms per chunk (median of {ITERS} steps' micro-batches)")
    balance: dict[str, float] = {}
    for split in SPLITS:
        print(f"  {split:<9} chunks {ranks[0]['chunks'][split]} tokens")
        worst = 0.0
        for r in ranks:
            per = r["chunk_ms"][split]
            stage = r["rank"]  # pp = 2, one stage per rank
            row = [per[f"F {stage} {c}"] for c in range(K)]
            back = [per[f"B {stage} {c}"] for c in range(K)]
            spread = max(row) / min(row)
            worst = max(worst, spread)
            print(
                f"    stage {stage}: "
                + "  ".join(f"{t:7.1f}" for t in row)
                + f"   max/min {spread:.3f}   backward "
                + "  ".join(f"{t:7.1f}" for t in back)
            )
        balance[split] = worst
    ok = balance["measured"] <= 1.10
    print(
        f"  measured: worst max/min over stages {balance['measured']:.3f} (goal <= 1.10: "
        f"{'met' if ok else 'MISSED'}); balanced {balance['balanced']:.3f}, uniform "
        f"{balance['uniform']:.3f}"
    )
    record(
        "seq1f1b",
        "chunk forward max/min, measured split",
        balance["measured"],
        balance["uniform"],
        "uniform chunks",
        "<= 1.10",
        ok,
    )

    print("\npeak saved-activation bytes (MiB)")
    print(f"  {'rank':<6}" + "".join(f"{n:>24}" for n in names))
    for r in ranks:
        print(f"  {r['rank']:<6}" + "".join(f"{v / 2**20:>24.2f}" for v in r["saved"]))
    s0 = ranks[0]["saved"]
    theory = (P + K - 1) / (K * P)
    for i, split in enumerate(SPLITS, start=1):
        ratio = s0[i] / s0[0]
        print(
            f"stage 0, {split}: Seq1F1B / 1F1B = {ratio:.3f} (theory for equal chunks "
            f"{theory:.3f}; goal <= 0.70: {'met' if ratio <= 0.70 else 'MISSED'})"
        )
        record(
            "seq1f1b",
            f"stage-0 peak saved bytes, {split}",
            s0[i] / 2**20,
            s0[0] / 2**20,
            "autopart 1F1B",
            "<= 0.70",
            ratio <= 0.70,
            "MiB",
        )

    print(
        f"\nstep time: median of {ITERS} after {WARMUP} warm-up (forward + backward; the slower rank)"
    )
    tokens = BATCH * a.seq
    for n, t in zip(names, ms, strict=True):
        print(
            f"  {n:<26} {t:8.1f} ms/step  {tokens / t * 1e3:9.0f} tokens/s   vs 1F1B "
            f"{ms[0] / t:5.3f}x   step-0 loss {ranks[-1]['loss0'][n]:.6f}"
        )
    fastest_balance = min(ms[1], ms[2])
    print(
        f"balanced (FLOPs) / uniform step time: {ms[1] / ms[3]:.3f}; measured / uniform: "
        f"{ms[2] / ms[3]:.3f} (goal: balanced at least as fast as uniform: "
        f"{'met' if fastest_balance <= ms[3] else 'MISSED'})"
    )
    for i, split in enumerate(SPLITS, start=1):
        record(
            "seq1f1b",
            f"step time at {a.seq} tokens, {split}",
            ms[i],
            ms[0],
            "autopart 1F1B",
            "< 1.0",
            ms[i] < ms[0],
            "ms",
        )
    record(
        "seq1f1b",
        f"step time at {a.seq} tokens, measured",
        ms[2],
        ms[3],
        "uniform chunks",
        "<= 1.0",
        ms[2] <= ms[3],
        "ms",
    )
    record(
        "seq1f1b",
        f"step time at {a.seq} tokens, measured",
        ms[2],
        ms[4],
        "torch.distributed.pipelining Schedule1F1B",
        unit="ms",
    )
    return 0 if losses_agree(ranks[-1]["loss0"], names[0], RTOL) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="RESULT_JSON", help="internal: run as a torchrun rank")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches (default 8)")
    ap.add_argument("--manual", action="store_true", help="torch: the manual PipelineStage API")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.seq, a.microbatches, a.manual)
        sys.stdout.flush()
        os._exit(
            0
        )  # skip interpreter teardown, where gloo threads can abort (see autopart/runtime/run.py)
    sys.exit(main(a))
