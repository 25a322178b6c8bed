"""The planner's closed loop on this machine: plan for 4 CPU ranks, run the plans, compare.

1. **profile** — ``cpu_profile.measure(4)``: 4 gloo processes (one thread each) measure float32
   matmul throughput (alone and all at once: what taking turns costs beyond the share of the
   cores), memory bandwidth, the cost of one graph node and a gloo all-reduce; the result is a
   ``cpu_profile.Profile``: a ``Cluster`` and the ``SharedCores`` speed model of its cores.
2. **calibrate** — four single-rank plans (``ALONE``: micro-batches and Seq1F1B chunks) run in
   this process, alone on a core (``cpu_profile.step_times_alone``), and seven fixed plans
   (``CALIBRATION``: dp=4 with and without the distributed optimizer, tp=4, pp=4 1F1B and
   Seq1F1B k=4, tp=2 × pp=2 1F1B and Seq1F1B k=4 with SP) on 4 gloo ranks;
   ``cpu_profile.calibrate`` fits the compute rate, the per-kernel floor, the per-action cost,
   the cost of sharing the cores and the per-message latency to all eleven together. The
   profile is printed as TOML.
3. **plan** — ``planner.search`` ranks every plan of the model for 4 ranks on that profile,
   its shared cores as the speed model (dp/tp/pp, GPipe/1F1B/interleaved/Seq1F1B/zero-bubble,
   micro-batch sizes, chunk counts; no recomputation: memory is no constraint here).
4. **run** — the planner's top plans and others spread over its ranking (one plan per
   program, never a calibration plan's program) run on 4 gloo ranks (torchrun, one thread
   each) with the calibration plans again (spread evenly among them), one runner alive at a
   time, in two passes (the second in reverse order): the lower quartile of 8 training steps
   (forward, backward, AdamW; ZeRO-1 with the distributed optimizer), the slowest rank per
   step. That repeats in
   ``--launches`` launches (default 2), and each plan keeps its fastest. The profile is refitted
   to the calibration plans' times from the same launches (never to the plans compared).

The model: nanoGPT, 4 blocks of width 256 (8 heads), vocabulary 512, float32, a global batch of
8 sequences of 256 tokens. Goals (issue 19): Spearman rank correlation of predicted and measured
step times ≥ 0.8 over at least 8 plans; the planner's first plan within 10 % of the fastest
measured; every prediction within 15 %. Exits 1 when a goal is missed (closed_loop.md, beside
this file, has every run's figures).

    python benchmarks/closed_loop.py [--plans 10] [--save run.json] [--profile-out cpu.toml]
    python benchmarks/closed_loop.py --replay run.json   # re-predict a saved run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import record, run_workers  # noqa: E402

RANKS, BATCH, SEQ = 4, 8, 256
CONFIG = dict(n_layer=4, n_embd=256, n_head=8, vocab_size=512, block_size=512, dropout=0.0)
WARMUP, ITERS = 2, 8
# the cold-weight GEMM rate ``cpu_profile.measure`` gave on this machine (2026-11-25): where a
# saved run's profile predates the field, ``--replay`` starts the fit from it
COLD_GBPS = 9.6


def make():
    """The benchmark's model and batch (a model SPEC: ``benchmarks/closed_loop.py:make``)."""
    from autopart.models.nanogpt import GPT, GPTConfig, batch

    cfg = GPTConfig(**CONFIG)
    import torch

    torch.manual_seed(0)
    return GPT(cfg), batch(cfg, batch_size=BATCH, seq_len=SEQ)


def worker(out: str, plans_file: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopart
    from autopart.frontend.capture import capture
    from autopart.layout import Plan
    from autopart.runtime.run import make_optimizer

    from cpu_profile import training_steps, two_passes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, (x, y) = make()
    captured = capture(model, (x, y))
    plans = [Plan.from_json(data) for data in json.loads(Path(plans_file).read_text())]
    meshes: dict[tuple, object] = {}  # one device mesh per shape, shared by the runners

    def timed(j: int, n: int) -> list[float]:
        plan = plans[j]
        dims = tuple((d, getattr(plan, d)) for d in ("pp", "dp", "tp") if getattr(plan, d) > 1)
        if dims and dims not in meshes:
            meshes[dims] = init_device_mesh(
                "cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(d for d, _ in dims)
            )
        runner = autopart.parallelize(captured, meshes.get(dims), plan=plan)
        # a training step, as the simulator predicts it: AdamW, sharded over dp (ZeRO-1) when
        # the plan has the distributed optimizer
        optim = make_optimizer(runner, 1e-4, plan.distributed_optimizer)
        return training_steps(runner, optim, (x, y), n, WARMUP, sync=dist.barrier)

    # one runner alive at a time: with 16 runners in a process every step was 10-19 % slower
    # than with 2, and the more for the faster plans (closed_loop.md); two passes, the second
    # in reverse order, so the machine's drift falls on every plan alike
    steps = two_passes(len(plans), timed, ITERS)
    t = torch.tensor(steps, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step, the slowest rank
    # the lower quartile: on 2 cores shared by 4 ranks, other work only ever adds time, and the
    # same program moves by 20 % from step to step
    times = [statistics.quantiles(row, n=4, method="inclusive")[0] for row in t.tolist()]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


# fixed plans the profile is calibrated on (never among the plans compared)
CALIBRATION = [
    dict(micro_batch=1, dp=4),
    dict(micro_batch=2, tp=4, sequence_parallel=True),
    dict(micro_batch=1, pp=4, schedule="1f1b"),
    dict(micro_batch=2, tp=2, pp=2, schedule="1f1b"),
    dict(micro_batch=1, dp=4, distributed_optimizer=True),
    dict(micro_batch=2, pp=4, schedule="seq1f1b", seq_chunks=4),
    # many small tp collectives (64-token chunks, SP): without a plan like it the fit traded the
    # per-message latency for other terms, from 284 down to 6 µs (runs 24-27)
    dict(micro_batch=1, tp=2, pp=2, schedule="seq1f1b", seq_chunks=4, sequence_parallel=True),
]


# single-rank plans, run alone in this process: the compute rate, the per-kernel floor and the
# per-action cost are fitted to them (no other rank, no message)
ALONE = [
    dict(micro_batch=8),
    dict(micro_batch=1),
    dict(micro_batch=1, schedule="seq1f1b", seq_chunks=4),
    dict(micro_batch=4, schedule="seq1f1b", seq_chunks=2),
]


def _run(plans: list) -> list[float] | None:
    """Median step seconds of each plan, run on RANKS gloo ranks in one launch."""
    with tempfile.TemporaryDirectory() as tmp:
        plans_file = str(Path(tmp) / "plans.json")
        Path(plans_file).write_text(json.dumps([p.to_json() for p in plans]))
        return run_workers(__file__, RANKS, plans_file)


def _interleave(n: int, c: int) -> list[int]:
    """Indices 0 … n + c − 1 in run order: the c calibration plans (n … n + c − 1) spread evenly
    among the n compared plans (0 … n − 1)."""
    before = [int((i + 0.5) * n / c) for i in range(c)]  # the compared plan each goes before
    out = []
    for j in range(n + 1):
        out += [n + i for i in range(c) if before[i] == j]
        if j < n:
            out.append(j)
    return out


def _rank(shape, profile) -> list:
    from autopart.planning.planner import search

    return search(
        shape,
        profile.cluster,
        RANKS,
        BATCH,
        top=1000,
        recompute=["none"],
        micro_batches=[1, 2, 4],
        seq_chunks=[2, 4],
        max_tp=RANKS,
        speed=profile.sharing,
    ).ranked


def show_calibration(calib: list, times: list[float]) -> None:
    print(
        "calibrated on "
        + ", ".join(f"{p.describe()} ({1e3 * t:.0f} ms)" for p, t in zip(calib, times, strict=True))
    )


def _program(plan) -> str:
    """What runs: plans whose schedules give the same actions (GPipe and 1F1B when no rank
    has a steady phase) are one program."""
    from autopart.planning.simulate.iteration import _actions

    st = plan
    acts = _actions(
        st.schedule, st.pp, st.microbatches, st.virtual_stages, st.seq_chunks, False, False
    )
    return repr((plan.to_json() | {"schedule": ""}, acts))


def choose(ranked: list, n: int) -> list:
    """The top half of ``n`` from the head of the ranking, the rest spread evenly over it (one
    plan per program)."""
    seen_programs: set[str] = set()
    unique = []
    for r in ranked:
        key = _program(r.plan)
        if key not in seen_programs:
            seen_programs.add(key)
            unique.append(r)
    ranked = unique
    head = max(1, n // 2)
    rest = ranked[head:]
    k = n - head
    picked = [rest[round(i * (len(rest) - 1) / max(k - 1, 1))] for i in range(k)] if rest else []
    seen, out = set(), []
    for r in ranked[:head] + picked:
        key = r.plan.describe()
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--plans", type=int, default=10, help="plans to run (default 10)")
    ap.add_argument(
        "--save", metavar="JSON", help="write the measured profile and step times to this file"
    )
    ap.add_argument(
        "--replay",
        metavar="JSON",
        help="measure nothing: calibrate and predict again from a file --save wrote",
    )
    ap.add_argument(
        "--profile-out",
        metavar="TOML",
        help="write the profile fitted in the compared plans' launch: the cluster, which autopart "
        "plan --cluster reads (without the shared cores, which autopart does not model)",
    )
    ap.add_argument(
        "--launches",
        type=int,
        default=2,
        help="launches of the compared plans, each with the calibration plans again; a plan's "
        "time is its fastest launch (default 2)",
    )
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.launches < 1:
        ap.error("--launches must be at least 1")
    if a.worker:
        worker(*a.worker)
        return 0

    from scipy.stats import spearmanr

    from autopart.frontend.capture import capture
    from autopart.layout import Plan
    from autopart.planning.simulate import shape_from_captured

    from cpu_profile import Profile, calibrate, measure, step_times_alone, to_toml

    model, (x, y) = make()
    captured = capture(model, (x, y))
    shape = shape_from_captured(captured)
    calib = [Plan.from_batch(BATCH, **c) for c in CALIBRATION]
    alone = [Plan.from_batch(BATCH, **c) for c in ALONE]
    if a.replay:
        saved = json.loads(Path(a.replay).read_text())
        # runs saved before a field: the runtime's tp groups exchanged then too, the fit starts
        # the cold weight's rate from this machine's, and the runtime filled its waits (run 31 on)
        before = {"tp_exchange": True, "mm_weight_gbps": COLD_GBPS, "fill_waits": True}
        profile = Profile.from_json(before | saved["profile"])
        cal_times = [t for _, t in saved["calibration"]]
        calib = [Plan.from_json(pl) for pl, _ in saved["calibration"]]
        alone = [Plan.from_json(pl) for pl, _ in saved["alone"]]
        alone_times = [t for _, t in saved["alone"]]
        print(f"replaying {a.replay}: nothing is measured")
    else:
        t0 = time.perf_counter()
        profile = measure(RANKS, hidden=CONFIG["n_embd"], tokens=BATCH * SEQ // RANKS)
        print(f"micro-benchmarks of this CPU for {RANKS} ranks ({time.perf_counter() - t0:.0f} s)")
        alone_times = step_times_alone(captured, (x, y), alone)
        cal_times = _run(calib)
        if cal_times is None:
            return 1
    # one rank alone pins what a rank computes; the ranks' runs what sharing and talking cost
    single = list(zip(alone, alone_times, strict=True))
    fitted = calibrate(profile, shape, single + list(zip(calib, cal_times, strict=True)))
    print(
        "one rank alone: "
        + ", ".join(
            f"{p.describe()} ({1e3 * t:.0f} ms, fitted {1e3 * fitted.seconds(shape, p):.0f} ms)"
            for p, t in single
        )
    )
    show_calibration(calib, cal_times)
    print(to_toml(fitted))
    ranked = _rank(shape, fitted)
    print(f"the planner ranked {len(ranked)} plans for {shape.describe()}")
    if a.replay:
        plans = [Plan.from_json(pl) for pl, _ in saved["runs"]]
        measured = [t for _, t in saved["runs"]]
        again = [t for _, t in saved["calibration_again"]]
        launches = saved.get("launches", [])
    else:
        taken = {_program(p) for p in calib}
        plans = [
            r.plan for r in choose([r for r in ranked if _program(r.plan) not in taken], a.plans)
        ]
        # the chosen plans and the calibration plans again, in each launch: step times move by
        # up to 30 % between launches here; each plan's time is its fastest launch, since other
        # work only ever adds time (one plan measured 979 and 1185 ms in two launches, run 22)
        launches = []
        for i in range(a.launches):
            print(f"launch {i + 1} of {a.launches}: {len(plans)} plans and {len(calib)} again")
            # the calibration plans spread among the compared ones, so that the machine's drift
            # within a launch falls on both alike (run 23: the calibration plans, measured
            # together mid-launch, ran 0-12 % slower in one launch and set the refit)
            order = _interleave(len(plans), len(calib))
            got = _run([(plans + calib)[j] for j in order])
            if got is None:
                return 1
            both = [0.0] * len(order)
            for j, t in zip(order, got, strict=True):
                both[j] = t
            launches.append(both)
        best = [min(col) for col in zip(*launches, strict=True)]
        measured, again = best[: len(plans)], best[len(plans) :]
    # recalibrated on this launch's calibration plans (never on the plans compared)
    fitted = calibrate(profile, shape, single + list(zip(calib, again, strict=True)))
    print("\nrecalibrated in the launch of the compared plans:")
    show_calibration(calib, again)
    if a.profile_out:
        Path(a.profile_out).write_text(to_toml(fitted))
        print(f"wrote the profile to {a.profile_out}")
    ranked = _rank(shape, fitted)
    rank_of = {r.plan.describe(): i + 1 for i, r in enumerate(ranked)}
    predicted = [fitted.seconds(shape, pl) for pl in plans]
    # the planner's first plan: the best ranked of those measured
    order = sorted(range(len(plans)), key=lambda i: rank_of.get(plans[i].describe(), 10**9))
    plans, measured, predicted = (
        [plans[i] for i in order],
        [measured[i] for i in order],
        [predicted[i] for i in order],
    )
    if a.save:
        Path(a.save).write_text(
            json.dumps(
                {
                    "profile": profile.to_json(),
                    "alone": [[p.to_json(), t] for p, t in zip(alone, alone_times, strict=True)],
                    "calibration": [
                        [p.to_json(), t] for p, t in zip(calib, cal_times, strict=True)
                    ],
                    "calibration_again": [
                        [p.to_json(), t] for p, t in zip(calib, again, strict=True)
                    ],
                    "runs": [[p.to_json(), t] for p, t in zip(plans, measured, strict=True)],
                    # every launch's times, in launch order: the compared plans as first
                    # chosen (before the ranking's order), then the calibration plans
                    "launches": launches,
                },
                indent=1,
            )
        )
    print(f"\n{'#':>3}  {'plan':<64}{'predicted':>11}{'measured':>10}{'error':>8}")
    worst = 0.0
    for pl, p, m in zip(plans, predicted, measured, strict=True):
        err = p / m - 1
        worst = max(worst, abs(err))
        print(
            f"{rank_of.get(pl.describe(), 0):>3}  {pl.describe():<64}"
            f"{1e3 * p:>9.0f}ms{1e3 * m:>8.0f}ms{err:>+8.1%}"
        )
    rho = spearmanr(predicted, measured).statistic
    best = min(measured)
    first = measured[0] / best - 1
    print(
        f"\nSpearman {rho:.3f} over {len(plans)} plans (goal ≥ 0.8); the planner's first plan "
        f"{first:+.1%} against the fastest measured (goal ≤ 10 %); worst prediction error "
        f"{worst:.1%} (goal ≤ 15 %)"
    )
    record("closed_loop", "Spearman, predicted vs measured", rho, 0.8, "goal")
    record("closed_loop", "first plan vs fastest measured", 1 + first, 1.10, "goal")
    record("closed_loop", "worst prediction error", 100 * worst, 15.0, "goal", unit="%")
    return 0 if rho >= 0.8 and first <= 0.10 and worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
