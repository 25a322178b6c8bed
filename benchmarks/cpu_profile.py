"""A profile of this machine's CPU, measured and fitted: what the simulator needs to predict
plans for ranks that run here as gloo processes (the closed loop, ``closed_loop.py``).

A ``Profile`` is a ``Cluster`` (one rank's rates alone on a core) and a ``SharedCores`` speed
model (``shared_cores.py``: how the ranks slow each other on the machine's cores).
``measure(ranks)`` starts ``ranks`` processes (one thread each, as ``autopart run`` starts them)
that measure at the same time, so every figure is what one rank gets while the others work too:

- ``peak_tflops``: float32 matmul throughput at the shapes of the model's layer GEMMs (the
  median over the shapes), and ``mm_k_overhead`` from the same matmul with a quarter of the inner
  dimension (the model's k / (k + k0) law, solved for k0);
- ``hbm_tbps``: the bytes an elementwise add moves per second on tensors far larger than cache;
- ``mm_weight_gbps``: how fast a GEMM of few rows (a Seq1F1B chunk's) reads a weight that is not
  in cache, beyond its math: a CPU GEMM packs its weight from memory on every call, which the
  GPU model's max(math, memory) hides;
- ``kernel_launch_us``: the time of one operator of a traced (``torch.fx``) graph on a tiny
  tensor — what the runtime pays per node beyond its arithmetic — times the graph's nodes per
  kernel the cost model counts (``NODES_PER_KERNEL``);
- the link (``nvlink_*``, one "node" of ``ranks`` ranks): a gloo all-reduce of a large and of a
  small tensor over all ranks, solved for the ring's bandwidth and per-step latency;
- the shared cores' ``slowdown``: one matmul alone against the same matmul on every rank at once.

``calibrate(profile, shape, runs)`` then refits the compute rate, the cold weight's rate, the
per-kernel floor, the per-action cost, the shared cores' slowdown and the per-message latency to
measured step times of real plans. ``closed_loop.md`` gives the figures measured here and how
well the planner ranks real runs with them.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from autopart.api import parallelize
from autopart.errors import AutopartError
from autopart.planning.cluster import Cluster, cluster_from_dict
from autopart.planning.simulate import simulate
from autopart.runtime.comm import EXCHANGE_MAX
from autopart.runtime.run import make_optimizer
from autopart.runtime.runner import Runner

from shared_cores import SharedCores  # benchmarks/ is on the path (the scripts put it there)

# rows of the GEMM that measures how fast a weight not in cache is read (``mm_weight_gbps``)
COLD_ROWS = 64

# The runtime's graphs hold about this many fx nodes (views, reshapes, adds, the autograd
# engine's own nodes in the backward) per kernel the cost model counts in a layer (4 GEMMs +
# attention + 6 memory-bound kernels forward). Read off nanoGPT's captured block: 37 forward
# nodes for 11 counted kernels.
NODES_PER_KERNEL = 37 / 11

# the profile's JSON keys of its speed model, beside the cluster's (the closed loop's saved runs)
SHARING = {"shared_cores": "cores", "shared_slowdown": "slowdown"}


class Profile(NamedTuple):
    """This CPU for the simulator: one rank's rates alone on a core, and how ranks computing at
    once slow each other (``simulate(shape, p.cluster, plan, speed=p.sharing)``)."""

    cluster: Cluster
    sharing: SharedCores

    def to_json(self) -> dict[str, Any]:
        """The cluster's fields and the speed model's, as ``--save`` writes them."""
        return self.cluster.to_json() | {k: getattr(self.sharing, f) for k, f in SHARING.items()}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Profile:
        rest = {k: v for k, v in data.items() if k not in SHARING}
        sharing = SharedCores(**{f: data[k] for k, f in SHARING.items()})
        return Profile(cluster_from_dict(rest, "profile"), sharing)

    def seconds(self, shape: Any, plan: Any) -> float:
        """The simulated step time of ``plan`` for ``shape`` on this CPU."""
        sim = simulate(shape, self.cluster, plan, record=False, speed=self.sharing)
        return sim.summary.iteration_s


def _timeit(fn: Any, window: float = 0.4, barrier: bool = True) -> float:
    """Mean seconds of ``fn`` over a ``window`` of wall time (every rank starts its window after
    a barrier and runs for the same time, so each sees the others busy throughout)."""
    import torch.distributed as dist

    fn()
    if barrier:
        dist.barrier()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < window:
        fn()
        n += 1
    return elapsed / n


def _worker(rank: int, ranks: int, hidden: int, tokens: int, path: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.fx

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    h, T = hidden, tokens
    out: dict[str, float] = {}

    # rank 0 alone (the others wait at the barrier, asleep): the rates of one rank on a core
    if rank == 0:
        a, b = torch.randn(T, h), torch.randn(h, 4 * h)
        out["gemm_alone"] = 2 * T * h * 4 * h / _timeit(lambda: a @ b, barrier=False)
        x, y, z = torch.randn(4 << 20), torch.randn(4 << 20), torch.empty(4 << 20)
        out["mem_alone"] = 12 * (4 << 20) / _timeit(lambda: torch.add(x, y, out=z), barrier=False)
        # a Seq1F1B chunk's GEMM: few rows against a weight not in cache (one of 24 in turn)
        rows, ws, turn = torch.randn(COLD_ROWS, h), [torch.randn(h, 4 * h) for _ in range(24)], [0]

        def cold() -> None:
            turn[0] = (turn[0] + 1) % len(ws)
            rows @ ws[turn[0]]

        out["gemm_cold_s"] = _timeit(cold, barrier=False)
    dist.barrier()
    a, b = torch.randn(T, h), torch.randn(h, 4 * h)
    out["gemm_crowd"] = 2 * T * h * 4 * h / _timeit(lambda: a @ b)
    rates = []
    for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
        a, b = torch.randn(T, k), torch.randn(k, n)
        rates.append(2 * T * k * n / _timeit(lambda a=a, b=b: a @ b))
    out["gemm"] = statistics.median(rates)
    a, b = torch.randn(T, h // 4), torch.randn(h // 4, 4 * h)
    out["gemm_short_k"] = 2 * T * (h // 4) * 4 * h / _timeit(lambda: a @ b)

    dist.barrier()
    x, y, z = torch.randn(4 << 20), torch.randn(4 << 20), torch.empty(4 << 20)
    out["mem"] = 12 * (4 << 20) / _timeit(lambda: torch.add(x, y, out=z))

    dist.barrier()

    class Tiny(torch.nn.Module):
        def forward(self, v: torch.Tensor) -> torch.Tensor:
            for _ in range(50):
                v = v + 1
            return v

    gm = torch.fx.symbolic_trace(Tiny())
    v = torch.zeros(8)
    out["op"] = _timeit(lambda: gm(v)) / 50

    dist.barrier()
    for name, numel in (("ar_big", 4 << 20), ("ar_small", 16)):
        t = torch.zeros(numel)
        dist.barrier()
        reps = 5 if numel > 16 else 50  # a fixed count: every rank must join every call
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        out[name] = (time.perf_counter() - start) / reps

    every: list[Any] = [None] * ranks
    dist.all_gather_object(every, out)
    if rank == 0:
        import json

        Path(path).write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()


def raw(ranks: int = 4, hidden: int = 256, tokens: int = 512) -> list[dict[str, float]]:
    """Every rank's raw figures (``_worker``), measured by ``ranks`` processes at once."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "raw.json")
        mp.start_processes(
            _worker,
            args=(ranks, hidden, tokens, path, port),
            nprocs=ranks,
            join=True,
            start_method="spawn",
        )
        return json.loads(Path(path).read_text())


def measure(
    ranks: int = 4,
    hidden: int = 256,
    tokens: int = 512,
    name: str = "cpu",
    cores: int | None = None,
) -> Profile:
    """The profile of this machine for ``ranks`` CPU ranks (one thread each) on ``cores`` cores
    (default: this machine's), measured at GEMMs of width ``hidden`` over ``tokens`` rows (the
    model's sizes give the best figures). The ranks measure at once, each getting cores / ranks
    of a core; the cluster holds one rank's rates alone on a core, and its ``SharedCores``
    shares the cores among the ranks that compute at each moment."""
    cores = cores or os.cpu_count() or 1
    rows = raw(ranks, hidden, tokens)
    crowd = max(1.0, ranks / cores)  # measured rate × crowd = a rank's rate alone on a core

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    # sharing the node costs more than the share of the cores: one rank's matmul rate alone
    # against its rate among ``ranks`` (the same matmul), beyond cores / ranks
    alone = rows[0]["gemm_alone"]
    slowdown = max(0.0, alone / crowd / med("gemm_crowd") - 1) if ranks > 1 else 0.0
    peak = med("gemm") * crowd * (1 + slowdown)
    # k / (k + k0) = short-k rate / rate at k = h … 4h (taken at k = h)
    ratio = min(med("gemm_short_k") / med("gemm"), 0.999)
    k = hidden // 4
    k0 = max(k * (1 / ratio - 1), 1e-3)
    # the cold GEMM's time beyond its math at the rate alone: its weight read from memory
    h = hidden
    beyond = rows[0]["gemm_cold_s"] - 2 * COLD_ROWS * h * 4 * h / alone
    weight_gbps = 4 * h * 4 * h / max(beyond, 1e-7) / 1e9
    n = ranks
    big = 4 * (4 << 20)  # bytes of the large all-reduce
    alpha = med("ar_small") / (2 * (n - 1)) if n > 1 else 1e-6
    bw = 2 * (n - 1) / n * big / max(med("ar_big") - 2 * (n - 1) * alpha, 1e-9) if n > 1 else 1e12
    cluster = Cluster(
        name=name,
        gpus_per_node=ranks,
        peak_tflops=peak / 1e12,
        hbm_gib=64.0,
        hbm_tbps=rows[0]["mem_alone"] / 1e12,
        nvlink_gbps=bw / 1e9,
        ib_nics_per_node=1,
        ib_gbit_per_nic=8 * bw / 1e9,
        sms=1,
        mm_efficiency=1.0,
        mm_k_overhead=k0,
        mm_weight_gbps=weight_gbps,
        attn_efficiency=1.0,
        hbm_efficiency=1.0,
        kernel_launch_us=med("op") / crowd / (1 + slowdown) * 1e6 * NODES_PER_KERNEL,
        action_overhead_us=100.0,  # a starting point for ``calibrate``
        nvlink_efficiency=1.0,
        ib_efficiency=1.0,
        nvlink_latency_us=alpha * 1e6,
        ib_latency_us=alpha * 1e6,
        usable_memory_fraction=0.9,
        attention="flash",
        act_bytes=4.0,
        grad_bytes=4.0,
        # gloo's reduction copies and sums on the cores the backward runs on: on shared cores
        # it does not hide behind the backward (the closed loop's worst error fell from 25-32 %
        # to 17-26 % over runs 12-14 replayed, closed_loop.md)
        grad_overlap=False,
        p2p_scatter_gather=False,
        # the runtime's tp collectives on gloo groups of up to 4 ranks (shared memory or
        # isend/irecv): one exchange each, so sequence parallelism's four per layer cost twice
        # the latency of the two all-reduces without it
        tp_exchange=ranks <= EXCHANGE_MAX,
        fill_waits=True,  # the runtime's work while waiting (CPU ranks, zero-bubble schedules)
    )
    return Profile(cluster, SharedCores(float(min(cores, ranks)), slowdown))


def to_toml(profile: Profile) -> str:
    """The profile as TOML: the cluster, which ``load_cluster`` (``autopart plan --cluster``)
    reads back, and its shared cores as a comment, which autopart's simulator does not model."""
    lines = [
        f"# shared cores (benchmarks/shared_cores.py): cores = {profile.sharing.cores!r}, "
        f"slowdown = {profile.sharing.slowdown!r}"
    ]
    for key, value in profile.cluster.to_json().items():
        if isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, str):
            lines.append(f'{key} = "{value}"')
        else:
            lines.append(f"{key} = {value!r}")
    return "\n".join(lines) + "\n"


# what a rank computes (the GEMM rate, the rate a cold weight is read at, the per-kernel floor,
# the runtime's cost per action)
# and what taking turns on the cores and talking cost: fitted together to single-rank
# runs alone on a core (``step_times_alone``: they pin the compute, with no other rank and no
# message) and to runs of plans on all the ranks (they split the per-action cost from the
# floor, since a pipeline stage holds fewer kernels per action, and set the rest); the
# profile's JSON keys (``Profile.to_json``)
CALIBRATED = (
    "peak_tflops",
    "mm_weight_gbps",
    "kernel_launch_us",
    "action_overhead_us",
    "shared_slowdown",
    "nvlink_latency_us",
)


def calibrate(
    profile: Profile,
    shape: Any,
    runs: list[tuple[Any, float]],
    names: tuple[str, ...] = CALIBRATED,
) -> Profile:
    """``profile`` with the figures ``names`` refitted (least squares of the log errors, each
    scaled by a factor within e^±5) so the simulator reproduces measured step times
    ``runs`` = [(plan, seconds)] of ``shape`` (the closed loop: one rank's runs alone and the
    ranks' runs together)."""
    from scipy.optimize import least_squares

    data = profile.to_json()
    start = {n: data[n] or 0.05 for n in names}  # a factor needs a start above 0

    def at(x: Any) -> Profile:
        return Profile.from_json(
            data | {n: start[n] * math.exp(v) for n, v in zip(names, x, strict=True)}
        )

    def residuals(x: Any) -> list[float]:
        fitted = at(x)
        return [math.log(fitted.seconds(shape, plan) / t) for plan, t in runs]

    sol = least_squares(
        residuals, [0.0] * len(names), bounds=(-5.0, 5.0), diff_step=1e-4, xtol=1e-10, ftol=1e-10
    )
    return at(sol.x)


def training_steps(
    runner: Any, optim: Any, batch: tuple[Any, Any], n: int, warmup: int, sync: Any = None
) -> list[float]:
    """Seconds of ``n`` training steps (forward, backward, ``optim``) after ``warmup``;
    ``sync()`` (a barrier, for ranks) runs before each step, outside the time."""
    out = []
    for i in range(warmup + n):
        optim.zero_grad(set_to_none=True)
        if sync is not None:
            sync()
        start = time.perf_counter()
        runner.step(*batch)
        optim.step()
        if i >= warmup:
            out.append(time.perf_counter() - start)
    return out


def two_passes(count: int, timed: Any, steps: int) -> list[list[float]]:
    """``timed(j, n)``'s step times for plans 0 … count − 1: two passes of ``steps`` / 2 steps,
    the second in reverse order, so the machine's drift falls on every plan alike. Whatever
    ``timed`` built is collected before the next call: one runner alive at a time."""
    import gc

    times: list[list[float]] = [[] for _ in range(count)]
    order = list(range(count))
    for pass_order in (order, order[::-1]):
        for j in pass_order:
            times[j] += timed(j, max(1, steps // 2))
            gc.collect()
    return times


def step_times_alone(
    captured: Any, batch: tuple[Any, Any], plans: list[Any], steps: int = 8, warmup: int = 2
) -> list[float]:
    """Seconds of one training step (forward, backward, AdamW) of each single-rank ``plan``
    (dp = tp = pp = 1: micro-batches and Seq1F1B chunks only) of ``captured``, in this process
    on one thread: the lower quartile of ``steps``. One runner is alive at a time, as in the
    closed loop's ranks; two passes (the second in reverse order) of ``warmup`` + steps / 2."""
    import torch

    for plan in plans:
        if plan.gpus != 1:
            raise AutopartError(
                f"step_times_alone runs one rank, not {plan.describe()}",
                hint="pass plans with dp = tp = pp = 1 (micro-batches and Seq1F1B chunks)",
            )

    def timed(j: int, n: int) -> list[float]:
        rp = (prog := parallelize(captured, None, plan=plans[j])).rank(0)
        weights = {f: rp.shards[f].local(t.detach().clone()) for f, t in prog.params.items()}
        runner = Runner(rp, prog.plan, {**weights, **prog.buffers}, {})
        return training_steps(runner, make_optimizer(runner, 1e-4), batch, n, warmup)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = two_passes(len(plans), timed, steps)
        # inclusive: within the samples (the default extrapolates: 2 samples gave a negative time)
        return [
            statistics.quantiles(t, n=4, method="inclusive")[0] if len(t) > 1 else t[0]
            for t in times
        ]
    finally:
        torch.set_num_threads(threads)


__all__ = [
    "CALIBRATED",
    "Profile",
    "calibrate",
    "measure",
    "raw",
    "step_times_alone",
    "training_steps",
    "two_passes",
    "to_toml",
]
