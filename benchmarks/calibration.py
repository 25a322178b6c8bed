"""Calibrated simulation: predict a real pipeline run on this machine from measured action costs.

On 2 gloo ranks (pp=2, torchrun launched here, 1 thread each), HF GPT-2 (4 blocks, width 256,
8 heads, vocabulary 1024, float32) trains on sequences of 512 tokens, one per micro-batch:

1. **profile** — with 4 micro-batches, 1F1B and Seq1F1B (k = 2): every F and B action's duration
   (``runner.timeline``, 3 steps after 1 warm-up), reduced to the median per (stage, chunk,
   kind): the *per-action costs*; the tied-embedding gradient all-reduce likewise; a ping-pong of
   one activation (the p2p transfer time, divided by k for a chunk); and the step's fixed
   overhead outside the actions (step time − span of the recorded actions: batch slicing, the
   loss all-reduce);
2. **predict** — ``autopart.simulate.simulate_actions`` runs the schedule IR of the run to predict
   (the same generators the runtime uses, 8 micro-batches) with those costs, plus the overhead;
3. **measure** — the run itself, with 8 micro-batches: median step time of 5 steps after 1
   warm-up (the slower rank).

Goal: predicted within 15 % of measured, for both schedules.

    python benchmarks/calibration.py
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import record, run_workers  # noqa: E402

GPT2 = dict(vocab_size=1024, n_positions=512, n_embd=256, n_layer=4, n_head=8, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
P, SEQ, PROFILE_M, RUN_M, K = 2, 512, 4, 8, 2
PLANS = {"1f1b": dict(schedule="1f1b"), "seq1f1b": dict(schedule="seq1f1b", seq_chunks=K)}


def build(m: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, GPT2["vocab_size"], (m, SEQ + 1), generator=g)
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _steps(runner, x, y, n: int, warmup: int, record_timeline: bool):
    import torch.distributed as dist

    times, timelines = [], []
    for i in range(warmup + n):
        for p in runner.parameters():
            p.grad = None
        dist.barrier()
        runner.timeline = [] if record_timeline else None
        start = time.perf_counter()
        runner.step(x, y)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            timelines.append(list(runner.timeline or []))
    return times, timelines


def _ping_pong(numel: int, rank: int, repeats: int = 20) -> float:
    """One-way time of a p2p transfer of ``numel`` float32 values (half a round trip)."""
    import torch.distributed as dist

    t = torch.zeros(numel)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
    return (time.perf_counter() - start) / repeats / 2


def worker(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopart

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("pp",))
    rank = dist.get_rank()
    result = {"transfer_s": _ping_pong(SEQ * GPT2["n_embd"], rank)}
    for name, plan in PLANS.items():
        model, (x, y) = build(PROFILE_M)
        runner = autopart.parallelize(model, mesh, example_inputs=(x, y), microbatches=PROFILE_M,
                                      **plan)  # fmt: skip
        profile_s, timelines = _steps(runner, x, y, 3, 1, True)
        model, (x, y) = build(RUN_M)
        runner = autopart.parallelize(
            model, mesh, example_inputs=(x, y), microbatches=RUN_M, **plan
        )
        times, _ = _steps(runner, x, y, 5, 1, False)
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        result[name] = {"timelines": timelines, "step_s": t.tolist(), "profile_s": profile_s}
    every = [None] * P
    dist.all_gather_object(every, result)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()


_UNIT = re.compile(r"\(s(\d+),m(\d+)(?:,c(\d+))?\)")


def action_costs(timelines_by_rank: list[list[list]]) -> dict[tuple[str, int, int], float]:
    """Median duration of each (kind, stage, chunk) over every micro-batch and recorded step."""
    seen: dict[tuple[str, int, int], list[float]] = {}
    for timelines in timelines_by_rank:
        for tl in timelines:
            for name, kind, t0, t1 in tl:
                if kind in ("F", "B"):
                    s, _, c = _UNIT.search(name).groups()
                    seen.setdefault((kind, int(s), int(c or 0)), []).append(t1 - t0)
    return {key: statistics.median(v) for key, v in seen.items()}


def predict(name: str, ranks: list[dict]) -> tuple[float, float]:
    """(predicted step seconds at RUN_M micro-batches, bubble fraction) from the profile."""
    from autopart.schedule import generate
    from autopart.simulate import simulate_actions

    timelines = [r[name]["timelines"] for r in ranks]
    costs = action_costs(timelines)
    tie = statistics.median(e - s for tls in timelines for tl in tls for _, k, s, e in tl
                            if k == "TIE_REDUCE")  # fmt: skip
    spans = [max(e for tl in step for *_, e in tl) - min(s for tl in step for _, _, s, _ in tl)
             for step in zip(*timelines, strict=True)]  # fmt: skip
    overhead = max(0.0, statistics.median(ranks[0][name]["profile_s"]) - statistics.median(spans))
    k = PLANS[name].get("seq_chunks", 1)
    actions = {r: generate(PLANS[name]["schedule"], r, RUN_M, list(range(P)), tied=True, k=k)
               for r in range(P)}  # fmt: skip
    transfer = statistics.median(r["transfer_s"] for r in ranks) / k
    tl = simulate_actions(
        actions,
        lambda a: {"TIE_REDUCE": tie, "DP_REDUCE": 0.0}.get(
            a.kind, costs.get((a.kind, a.stage, a.chunk))
        ),
        lambda a: transfer,
        record=False,
    )
    return tl.span + overhead, tl.bubble_fraction


def main() -> int:
    ranks = run_workers(__file__, P)
    if ranks is None:
        return 2
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 1 thread/rank "
          "(the cores may be shared with other processes: expect noise)")  # fmt: skip
    print(f"model: HF GPT2LMHeadModel {GPT2['n_layer']} x {GPT2['n_embd']}, V={GPT2['vocab_size']}, "
          f"float32, {SEQ} tokens per micro-batch, pp={P}; profiled at m={PROFILE_M}, "
          f"predicted and measured at m={RUN_M}")  # fmt: skip
    ok = True
    for name in PLANS:
        predicted, bubble = predict(name, ranks)
        measured = statistics.median(ranks[0][name]["step_s"])
        err = predicted / measured - 1
        ok &= abs(err) <= 0.15
        print(f"  {name:<8} predicted {predicted * 1e3:8.1f} ms (bubble {bubble:.3f})  measured "
              f"{measured * 1e3:8.1f} ms  error {err:+.1%}  "
              f"({'within' if abs(err) <= 0.15 else 'OUTSIDE'} 15 %)")  # fmt: skip
        record("calibration", f"pp=2 {name} step time, m={RUN_M}", predicted * 1e3, measured * 1e3,
               "the measured run", "within 15 %", abs(err) <= 0.15, "ms")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="RESULT_JSON", help="internal: run as a torchrun rank")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown, where gloo threads can abort (see autopart/run.py)
    sys.exit(main())
