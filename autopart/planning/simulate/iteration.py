"""One training iteration: ``simulate`` (shape, cluster, plan → ``Simulation``), the summary
it returns (time, throughput, memory, breakdown) and its tables."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from typing import Any, Literal

from autopart.layout import Plan
from autopart.planning.cluster import GIB, Cluster, load_cluster
from autopart.planning.simulate.events import (
    Event,
    Timeline,
    _compile,
    _Compiled,
    _run,
    to_chrome_trace,
)
from autopart.planning.simulate.performance import CostModel
from autopart.planning.simulate.shape import GPTShape
from autopart.planning.simulate.speed import DEDICATED, SpeedModel
from autopart.schedule.generators import generate
from autopart.schedule.ir import Action

EXACT_LIMIT = 400_000  # F and B actions in one pipeline above which ``simulate`` extrapolates


@dataclass(frozen=True)
class MemoryUse:
    """GiB per GPU on the pipeline rank that needs the most (``rank``): its parameters,
    gradients, optimizer states and activations (``saved_activations``: held between F and B
    only) and their ``total``, against the cluster's ``usable`` memory and ``capacity``; every
    rank's total and saved activations; ``activations_from`` "formula" or "graph" (read off the
    compiled program)."""

    rank: int
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    saved_activations: float
    total: float
    usable: float
    capacity: float
    per_rank_total: list[float]
    per_rank_saved_activations: list[float]
    activations_from: Literal["formula", "graph"]


@dataclass(frozen=True)
class Summary:
    """What one simulated iteration comes to (docs/simulate.md says what each counts).
    ``breakdown``: seconds by category (``compute_s``, ``tp_comm_s``, ``pp_comm_s``,
    ``dp_comm_s``, ``optimizer_s``, ``bubble_s``), means over the pipeline ranks;
    ``padded_vocab``: the model's vocabulary padded as the plan runs it. ``to_json()`` is what
    ``autopart simulate --json`` prints."""

    iteration_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    bubble_fraction: float
    memory_gb_per_gpu: float
    fits: bool
    memory: MemoryUse
    breakdown: dict[str, float]
    recompute_s: float
    flops_per_iteration: float
    model_flops_per_iteration: float
    gpus: int
    microbatches: int
    stage_layers: list[int]
    chunk_lengths: list[int]
    extrapolated: bool
    plan: Plan
    global_batch: int
    model: GPTShape
    cluster: str
    padded_vocab: int

    def to_json(self) -> dict[str, Any]:
        """The summary as JSON: its fields in order, ``plan`` as ``Plan.to_json()``, ``model``
        as the shape's fields with its ``params`` and ``padded_vocab``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "padded_vocab"}
        out["memory"] = asdict(self.memory)
        out["breakdown"] = dict(self.breakdown)
        out["plan"] = self.plan.to_json()
        out["model"] = {
            **asdict(self.model),
            "params": self.model.params,
            "padded_vocab": self.padded_vocab,
        }
        return out


@dataclass
class Simulation:
    """One simulated iteration: ``summary.to_json()`` is what ``autopart simulate --json``
    prints."""

    shape: GPTShape
    cluster: Cluster
    plan: Plan
    costs: CostModel
    timeline: Timeline
    summary: Summary

    @property
    def events(self) -> list[Event]:
        return self.timeline.events

    def chrome_trace(self) -> list[dict[str, Any]]:
        return to_chrome_trace(self.timeline.events)

    def to_json(self) -> dict[str, Any]:
        return self.summary.to_json()


@lru_cache(maxsize=256)
def _actions(
    schedule: str, p: int, m: int, v: int, k: int, dp: bool, tied: bool
) -> dict[int, list[Action]]:
    peers = list(range(p))
    return {
        r: generate(
            schedule, r, m, peers, dp=2 if dp else 1, v=v, tied=tied and r in (0, p - 1), k=k
        )
        for r in range(p)
    }


@lru_cache(maxsize=256)
def _compiled(schedule: str, p: int, m: int, v: int, k: int, dp: bool, tied: bool) -> _Compiled:
    return _compile(_actions(schedule, p, m, v, k, dp, tied))


def simulate(
    shape: GPTShape,
    cluster: Cluster | str,
    plan: Plan,
    *,
    record: bool = True,
    extrapolate: bool | None = None,
    memory: dict[tuple[int, int], tuple[int, int]] | None = None,
    speed: SpeedModel = DEDICATED,
) -> Simulation:
    """Simulate one iteration of ``plan`` for ``shape`` on ``cluster``.

    ``memory``: per-unit activation bytes of the compiled program
    (``planning.memory.graph_memory``) instead of the analytic formula. ``speed``: how ranks
    computing at once on a node slow each other (``simulate/speed.py``; default: not at all).

    ``extrapolate``: simulate 2·pp and 3·pp micro-batches and extend linearly to the real
    number (the steady state repeats every pp micro-batches); ``None`` does so only when the
    pipeline has more than ``EXACT_LIMIT`` F and B actions. Extrapolated runs have no events.
    """
    return simulate_costs(
        CostModel(shape, load_cluster(cluster), plan, memory, speed),
        record=record,
        extrapolate=extrapolate,
    )


def simulate_costs(
    costs: CostModel, *, record: bool = True, extrapolate: bool | None = None
) -> Simulation:
    """``simulate`` with a ready ``CostModel`` (the planner builds one per candidate)."""
    st = costs.st
    p, v, k, m = st.pp, st.virtual_stages, st.seq_chunks, st.microbatches
    if extrapolate is None:
        extrapolate = 2 * p * v * k * m > EXACT_LIMIT
    extrapolate = extrapolate and m > 3 * p
    key = (st.schedule, p, v, k, st.dp > 1, costs.tied_ranks)
    if extrapolate:
        runs = [_timed(costs, _compiled(key[0], p, mm, *key[2:]), None) for mm in (2 * p, 3 * p)]
        x = (m - 2 * p) / p
        span = runs[0].span + x * (runs[1].span - runs[0].span)
        ranks = {r: runs[0].ranks[r].scaled(runs[1].ranks[r], x) for r in runs[0].ranks}
        timeline = Timeline(span, ranks)
        acts = _actions(key[0], p, 3 * p, *key[2:])  # the peak is reached within 3·pp
    else:
        acts = _actions(key[0], p, m, *key[2:])
        timeline = _timed(costs, _compiled(key[0], p, m, *key[2:]), acts if record else None)
    summary = _summary(costs, timeline, acts, extrapolated=extrapolate)
    return Simulation(costs.shape, costs.cluster, st, costs, timeline, summary)


def _timed(costs: CostModel, comp: _Compiled, acts: dict[int, list[Action]] | None) -> Timeline:
    cost = [
        costs.transfer(a) if s else costs.action_cost(a)
        for a, s in zip(comp.keys, comp.is_send_key, strict=True)
    ]
    cl = costs.cluster
    return _run(
        comp,
        cost,
        acts,
        cl.grad_overlap,
        cl.p2p_overlap,
        cl.fill_waits,
        costs.speed,
        costs.placement(),
    )


def _summary(
    costs: CostModel, tl: Timeline, acts: dict[int, list[Action]], extrapolated: bool
) -> Summary:
    st, sh, cl = costs.st, costs.shape, costs.cluster
    p, m = st.pp, st.microbatches
    finish = {
        r: tl.ranks[r].end + costs.param_gather_time(r) + costs.optimizer_time(r) for r in range(p)
    }
    T = max(finish.values())
    cats = {
        "compute_s": 0.0,
        "tp_comm_s": 0.0,
        "pp_comm_s": 0.0,
        "dp_comm_s": 0.0,
        "optimizer_s": 0.0,
        "bubble_s": 0.0,
    }
    recompute = 0.0
    for r in range(p):
        comp = tp = rec = 0.0
        for s in range(r, costs.n_stages, p):
            for u in costs.units[s]:
                comp += m * (u.f + u.b)
                tp += m * (u.f_tp + u.b_tp)
                rec += m * u.recompute
        rt = tl.ranks[r]
        dp = rt.dp_wait + rt.tie_wait + costs.param_gather_time(r)
        opt = costs.optimizer_time(r)
        pp = rt.recv_exposed
        cats["compute_s"] += comp / p
        cats["tp_comm_s"] += tp / p
        cats["pp_comm_s"] += pp / p
        cats["dp_comm_s"] += dp / p
        cats["optimizer_s"] += opt / p
        cats["bubble_s"] += max(0.0, T - comp - tp - pp - dp - opt) / p
        recompute += rec / p
    hw, model = costs.hardware_flops(), costs.model_flops()
    gpus = st.gpus
    tflops = hw / T / gpus / 1e12
    mem = []
    for r in range(p):
        static = costs.static_bytes(r)
        act = costs.activation_peak(acts[r])
        mem.append(
            {
                **{k: v / GIB for k, v in static.items()},
                "activations": act / GIB,
                "saved_activations": costs.activation_peak(acts[r], transient=False) / GIB,
                "total": (sum(static.values()) + act) / GIB,
            }
        )
    worst = max(range(p), key=lambda r: mem[r]["total"])
    w = mem[worst]
    tokens = st.global_batch * sh.seq
    return Summary(
        iteration_s=T,
        tokens_per_s=tokens / T,
        tflops_per_gpu=tflops,
        mfu=model / T / gpus / (cl.peak_tflops * 1e12),
        hfu=tflops / cl.peak_tflops,
        bubble_fraction=cats["bubble_s"] / T,
        memory_gb_per_gpu=w["total"],
        fits=w["total"] * GIB <= cl.usable_bytes,
        memory=MemoryUse(
            rank=worst,
            parameters=w["parameters"],
            gradients=w["gradients"],
            optimizer=w["optimizer"],
            activations=w["activations"],
            saved_activations=w["saved_activations"],
            total=w["total"],
            usable=cl.usable_bytes / GIB,
            capacity=cl.hbm_gib,
            per_rank_total=[x["total"] for x in mem],
            per_rank_saved_activations=[x["saved_activations"] for x in mem],
            activations_from="formula" if costs.memory is None else "graph",
        ),
        breakdown=cats,
        recompute_s=recompute,
        flops_per_iteration=hw,
        model_flops_per_iteration=model,
        gpus=gpus,
        microbatches=m,
        stage_layers=costs.layers,
        chunk_lengths=list(costs.chunk_lengths),
        extrapolated=extrapolated,
        plan=st,
        global_batch=st.global_batch,
        model=sh,
        cluster=cl.name,
        padded_vocab=costs.vocab,
    )


def fast_lower_bound(costs: CostModel) -> float:
    """A lower bound on the iteration time, without simulating. For every pipeline rank r:

    - r starts after the first micro-batch's forwards on stages 0 … r−1 and then runs all its
      F and B: it ends its last backward at E_r or later;
    - then its gradient reduction of the stage of that backward still needs its time minus the
      backward's (it started with it), then the optimizer step (and the distributed
      optimizer's parameter all-gather);
    - the last micro-batch's backward still runs through stages r−1 … 0 after E_r, and rank 0
      then finishes the same way.

    Exact for equal stages and free communication (the closed forms); below the simulation
    otherwise, which makes the planner's branch and bound exact."""
    st = costs.st
    p, m = st.pp, st.microbatches

    def finish(r: int) -> float:
        u = costs.units[r][0]  # the rank's last backward: stage r (virtual chunk 0), chunk 0
        reduce = max(0.0, costs.dp_reduce_time(r) - (u.b + u.b_tp))
        return reduce + costs.optimizer_time(r) + costs.param_gather_time(r)

    best = prefix_f = prefix_b = 0.0
    for r in range(p):
        busy = sum(
            m * (u.f + u.f_tp + u.b + u.b_tp)
            for s in range(r, costs.n_stages, p)
            for u in costs.units[s]
        )
        end = prefix_f + busy
        best = max(best, end + finish(r), end + prefix_b + (finish(0) if r else 0.0))
        u0 = costs.units[r][0]
        prefix_f += u0.f + u0.f_tp
        prefix_b += u0.b + u0.b_tp
    return best


def breakdown_table(summary: Summary) -> list[tuple[str, float, float]]:
    """(category, seconds, share of the iteration) rows of a summary's breakdown."""
    T = summary.iteration_s
    return [
        (k.removesuffix("_s").replace("_", " "), v, v / T) for k, v in summary.breakdown.items()
    ]


def _gib(x: float) -> str:
    """GiB with a tenth, or MiB/KiB for a small model's activations (which would read 0.0)."""
    for unit, scale in (("GiB", 1), ("MiB", 2**10), ("KiB", 2**20)):
        if x * scale >= 0.95 or unit == "KiB":
            return f"{x * scale:.1f} {unit}"
    return ""


def print_summary(summary: Summary, console: Any) -> None:
    """A simulation's summary as rich tables."""
    from rich.table import Table

    plan = summary.plan
    mem = summary.memory
    head = Table(
        title=f"{plan.describe()} on {summary.gpus} × {summary.cluster}", show_header=False
    )
    head.add_column(justify="left")
    head.add_column(justify="right")
    rows = [
        (
            "iteration",
            f"{summary.iteration_s:.3f} s" + (" (extrapolated)" if summary.extrapolated else ""),
        ),
        ("tokens/s", f"{summary.tokens_per_s:,.0f}"),
        ("TFLOP/s per GPU (Megatron's count)", f"{summary.tflops_per_gpu:.1f}"),
        ("MFU / HFU", f"{summary.mfu:.1%} / {summary.hfu:.1%}"),
        ("bubble", f"{summary.bubble_fraction:.1%}"),
        (
            f"memory per GPU (rank {mem.rank})",
            f"{mem.total:.1f} GiB of {mem.usable:.1f} usable"
            + ("" if summary.fits else "  [red]does not fit[/red]"),
        ),
        (
            "  parameters / gradients / optimizer",
            f"{mem.parameters:.1f} / {mem.gradients:.1f} / {mem.optimizer:.1f} GiB",
        ),
        (
            "  activations"
            + (" (read off the compiled graphs)" if mem.activations_from == "graph" else ""),
            _gib(mem.activations),
        ),
    ]
    for k, v in rows:
        head.add_row(k, v)
    console.print(head)
    table = Table(title="where the time goes (mean over pipeline ranks)")
    for col in ("", "seconds", "share"):
        table.add_column(col, justify="right" if col else "left")
    for name, sec, share in breakdown_table(summary):
        table.add_row(name, f"{sec:.3f}", f"{share:.1%}")
    console.print(table)
