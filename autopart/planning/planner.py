"""The planner: search dp × tp × pp × v × micro-batch × schedule (Seq1F1B and its k) ×
recompute × sequence parallelism × distributed optimizer for a model, a cluster and a global
batch; keep the plans that fit in memory; rank them by simulated throughput.

    result = search(SHAPES["megatron-1t"], "dgx-a100-80gb", gpus=3072, global_batch=3072)
    for row in result.ranked:
        print(row.plan.describe(), row.summary.tflops_per_gpu, row.reason)

How it stays fast (docs/simulate.md, "The planner"):

1. **Layouts.** Every (tp, pp, dp, micro-batch, schedule, v, k) the generators and the shape
   allow: tp divides the heads, kv heads and ffn (at most one node by default), pp · tp · dp =
   gpus, dp · micro-batch divides the global batch, interleaved schedules need m % pp = 0 and
   layers % (pp·v) = 0.
2. **Variants** of each layout: recompute none / selective / full (selective only with unfused
   attention: a flash kernel already recomputes its scores), sequence parallelism on / off
   (tp > 1), distributed optimizer on / off (dp > 1). Each is costed without simulating: its
   memory (parameters, gradients, optimizer state, and the activation peak of pipeline ranks 0
   and pp−1 from the schedule's own F/B order) and a lower bound on its iteration time
   (``fast_lower_bound``: exact for equal stages and free communication). A variant that does
   not fit is dropped.
3. **Branch and bound.** The fitting variants are simulated in order of their bound
   (``simulate_costs``, extrapolated from 2·pp and 3·pp micro-batches, which is exact once the
   pipeline is in its steady state), keeping each layout's fastest; the search stops when the
   next bound exceeds the N-th best layout's simulated time. The bound is never above the
   simulation, so the top N are the model's true top N layouts.
4. **Near ties.** Plans within ``NEAR_TIE`` (1 %) of a faster one are ordered by memory, then
   by the actions a rank runs, least first: the model cannot tell them apart, the headroom is
   real, and every action is a launch and a hand-over the model prices least surely.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from autopart.errors import AutopartError
from autopart.layout import RECOMPUTE, SCHEDULES, Mesh, Plan
from autopart.planning.cluster import GIB, Cluster, load_cluster
from autopart.planning.simulate import (
    DEDICATED,
    CostModel,
    GPTShape,
    SpeedModel,
    _actions,
    fast_lower_bound,
    simulate_costs,
    stage_params,
)
from autopart.planning.simulate.iteration import Summary
from autopart.schedule.generators import generate, traits

MICRO_BATCHES = (1, 2, 4, 8)
# plans predicted this close (relative to the faster) are a tie: the model cannot order them (its
# error is 2.6 % on average against published runs, up to 15 % on this machine's CPU ranks),
# so the one that needs less memory ranks first, and at equal memory the simpler schedule
NEAR_TIE = 0.01
SEQ_CHUNKS = (2, 4, 8)
VIRTUAL = (2, 3, 4, 6, 8)


@dataclass
class Ranked:
    """One plan of the result: the plan, its simulated summary and why it ranks here."""

    plan: Plan
    summary: Summary
    lower_bound: float
    reason: str = ""
    notes: list[str] = field(default_factory=list)  # variants of the layout that lost, and why

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.describe(),
            "reason": self.reason,
            "notes": self.notes,
            "lower_bound_s": self.lower_bound,
            **self.summary.to_json(),
        }


@dataclass
class Search:
    """The planner's answer: the top plans, best first, and what the search did."""

    ranked: list[Ranked]
    stats: dict[str, Any]
    rejected: list[str]  # examples of plans refused for memory, with the numbers

    def to_json(self) -> dict[str, Any]:
        return {
            "plans": [r.to_json() for r in self.ranked],
            "stats": self.stats,
            "rejected_examples": self.rejected,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(
    shape: GPTShape,
    cluster: Cluster,
    gpus: int,
    global_batch: int,
    *,
    schedules: Iterable[str] = SCHEDULES,
    micro_batches: Iterable[int] = MICRO_BATCHES,
    seq_chunks: Iterable[int] = SEQ_CHUNKS,
    virtual: Iterable[int] = VIRTUAL,
    max_tp: int | None = None,
) -> list[dict[str, Any]]:
    """Every (tp, pp, dp, micro_batch, schedule, virtual_stages, seq_chunks) to try."""
    schedules = list(schedules)
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise AutopartError(
            f"unknown schedule {unknown[0]!r}", hint=f"choose from {', '.join(SCHEDULES)}"
        )
    max_tp = max_tp or cluster.gpus_per_node
    out = []
    for tp in _divisors(gpus):
        kv_unfit = shape.kv % tp and tp % shape.kv  # tp a multiple of them: replicated
        if tp > max_tp or shape.heads % tp or kv_unfit or shape.ffn_width % tp:
            continue
        for pp in _divisors(gpus // tp):
            if pp > shape.layers:
                continue
            dp = gpus // (tp * pp)
            if global_batch % dp:
                continue
            for b in micro_batches:
                if (global_batch // dp) % b:
                    continue
                m = global_batch // (dp * b)
                for sched in schedules:
                    if pp == 1 and sched != "1f1b":
                        continue  # one stage: every schedule is gradient accumulation
                    vs = [1]
                    if traits(sched).interleaved:
                        if m % pp:
                            continue
                        vs = [v for v in virtual if v > 1 and shape.layers % (pp * v) == 0]
                    ks = [1]
                    if traits(sched).chunked:
                        ks = [k for k in seq_chunks if k > 1 and 8 * k <= shape.seq]
                    for v in vs:
                        for k in ks:
                            out.append(
                                dict(
                                    tp=tp,
                                    pp=pp,
                                    dp=dp,
                                    virtual_stages=v,
                                    micro_batch=b,
                                    global_batch=global_batch,
                                    schedule=sched,
                                    seq_chunks=k,
                                )
                            )
    return out


def _variants(layout: dict[str, Any], recompute: Iterable[str], cluster: Cluster) -> list[Plan]:
    sps = (False, True) if layout["tp"] > 1 else (False,)
    dos = (False, True) if layout["dp"] > 1 else (False,)
    if cluster.attention == "flash":  # selective recompute is what the flash kernel's backward does
        recompute = [rc for rc in recompute if rc != "selective"] or ["none"]
    return [
        Plan.from_batch(
            **layout,
            recompute=rc,
            sequence_parallel=sp,
            distributed_optimizer=do,
        )
        for rc in recompute
        for sp in sps
        for do in dos
    ]


@cache
def _fb(
    schedule: str, p: int, m: int, v: int, k: int, r: int
) -> tuple[tuple[bool, int, int, bool], ...]:
    """Rank r's F, B and W units in schedule order (``generate``'s own order): (is a forward,
    stage, chunk, frees the unit's activations)."""
    acts = generate(schedule, r, m, list(range(p)), v=v, k=k)
    frees = "W" if traits(schedule).split_backward else "B"  # where a unit's activations go
    return tuple(
        (a.kind == "F", a.stage, a.chunk, a.kind == frees)
        for a in acts
        if a.kind in ("F", "B", "W")
    )


def _activation_peak(costs: CostModel, r: int) -> float:
    """``CostModel.activation_peak`` of rank r, from a schedule of at most 3·pp micro-batches:
    the warmup of every schedule but GPipe ends within 2·pp, and the steady state repeats
    every pp micro-batches. GPipe holds every forward before its first backward."""
    st = costs.st
    p, m = st.pp, st.microbatches
    units = costs.units
    if st.schedule == "gpipe" and p > 1:
        mine = [u for s in range(r, costs.n_stages, p) for u in units[s]]
        return m * sum(u.act for u in mine) + max(u.transient for u in mine)
    held = peak = 0.0
    for is_f, s, c, frees in _fb(
        st.schedule, p, min(m, 3 * p), st.virtual_stages, st.seq_chunks, r
    ):
        u = units[s][c]
        if is_f:
            held += u.act
            peak = max(peak, held)
            continue
        peak = max(peak, held + u.transient)
        if frees:
            held -= u.act
    return peak


def _gib(x: float) -> str:
    return f"{x / GIB:.2f} GiB"


def search(
    shape: GPTShape,
    cluster: Cluster | str,
    gpus: int,
    global_batch: int,
    *,
    top: int = 5,
    schedules: Iterable[str] = SCHEDULES,
    micro_batches: Iterable[int] = MICRO_BATCHES,
    seq_chunks: Iterable[int] = SEQ_CHUNKS,
    recompute: Iterable[str] = RECOMPUTE,
    attention: str | None = None,
    max_tp: int | None = None,
    progress: bool = False,
    console: Any = None,
    speed: SpeedModel = DEDICATED,
) -> Search:
    """Plan ``shape`` on ``gpus`` GPUs of ``cluster`` for ``global_batch`` sequences a step.

    Returns the ``top`` fastest plans that fit in memory (``Search.ranked``, best first),
    each simulated. ``attention`` overrides the cluster's attention kernel. ``progress`` shows a
    rich progress display (on ``console``, default stderr). ``speed``: how ranks computing at
    once on a node slow each other (``simulate.speed``; default: not at all).
    """
    t0 = time.perf_counter()
    cl = load_cluster(cluster)
    if attention is not None:
        cl = replace(cl, attention=attention)  # the Cluster checks the name
    if gpus < 1 or global_batch < 1 or top < 1:
        raise AutopartError(
            f"gpus ({gpus}), the global batch ({global_batch}) and top ({top}) must be positive"
        )
    recompute = list(recompute)
    for rc in recompute:  # refused now, not only when a layout reaches it
        Plan(Mesh(), recompute=rc)
    found = layouts(
        shape,
        cl,
        gpus,
        global_batch,
        schedules=schedules,
        micro_batches=micro_batches,
        seq_chunks=seq_chunks,
        max_tp=max_tp,
    )
    if not found:
        raise AutopartError(
            f"no layout of {gpus} GPUs fits a global batch of {global_batch}",
            hint="the global batch must be divisible by dp × micro-batch; try a batch that is "
            "a multiple of the GPU count",
        )
    prog = _Progress(progress, console)
    stats: dict[str, Any] = {
        "layouts": len(found),
        "variants": 0,
        "too_big": 0,
        "fitting_layouts": 0,
        "fitting_variants": 0,
        "simulated": 0,
    }
    rejected: list[tuple[float, str]] = []
    candidates: list[tuple[float, int, CostModel]] = []  # (bound, layout index, costs)
    notes: dict[int, list[str]] = {}
    usable = cl.usable_bytes
    with prog:
        task = prog.add(f"costing {len(found)} layouts", len(found))
        for index, layout in enumerate(found):
            too_big: list[tuple[float, str]] = []
            fitting = []
            for st in _variants(layout, recompute, cl):
                stats["variants"] += 1
                static = _static_peak(shape, st)
                if static > usable:
                    stats["too_big"] += 1
                    rejected.append(
                        (
                            static,
                            f"{st.describe()}: parameters, gradients and "
                            f"optimizer state alone need {_gib(static)}",
                        )
                    )
                    continue
                costs = CostModel(shape, cl, st, speed=speed)
                need = max(
                    sum(costs.static_bytes(r).values()) + _activation_peak(costs, r)
                    for r in {0, st.pp - 1}
                )
                bound = fast_lower_bound(costs)
                if need > usable:
                    stats["too_big"] += 1
                    rejected.append(
                        (need, f"{st.describe()}: needs {_gib(need)} (> {_gib(usable)})")
                    )
                    too_big.append((bound, f"{_knobs(st)} could be faster but needs {_gib(need)}"))
                    continue
                fitting.append((bound, index, costs))
            if fitting:
                low = min(b for b, _, _ in fitting)
                notes[index] = [text for b, text in sorted(too_big) if b < low][:1]
                candidates += fitting
            prog.advance(task)
        stats["fitting_layouts"] = len(notes)
        stats["fitting_variants"] = len(candidates)
        candidates.sort(key=lambda c: c[0])
        best: dict[int, Ranked] = {}  # per layout, its fastest simulated variant
        others: dict[int, list[tuple[float, str]]] = {}  # the layout's other simulated variants
        sim_task = prog.add(
            f"simulating the best of {len(candidates)} fitting plans", len(candidates)
        )
        for bound, index, costs in candidates:
            times = sorted(r.summary.iteration_s for r in best.values())
            if len(times) >= top and bound > times[top - 1]:
                break  # no later plan can enter the top N
            sim = simulate_costs(costs, record=False, extrapolate=True)
            stats["simulated"] += 1
            prog.advance(sim_task)
            if not sim.summary.fits:  # a middle rank over the limit
                rejected.append(
                    (
                        sim.summary.memory_gb_per_gpu * GIB,
                        f"{costs.st.describe()}: rank {sim.summary.memory.rank} "
                        f"needs {sim.summary.memory_gb_per_gpu:.2f} GiB",
                    )
                )
                continue
            held = best.get(index)
            if held is None or sim.summary.iteration_s < held.summary.iteration_s:
                if held is not None:
                    others.setdefault(index, []).append(
                        (held.summary.iteration_s, _knobs(held.plan))
                    )
                best[index] = Ranked(costs.st, sim.summary, bound, notes=list(notes[index]))
            else:
                others.setdefault(index, []).append((sim.summary.iteration_s, _knobs(costs.st)))
        prog.finish(sim_task)
    for index, row in best.items():
        if others.get(index):
            t, knobs = min(others[index])
            row.notes.append(f"next variant of this layout: {knobs}, {_secs(t)}")
    ranked = _break_near_ties(sorted(best.values(), key=lambda r: r.summary.iteration_s)[:top])
    if not ranked:
        smallest = min(rejected, default=(0.0, "nothing"))[1]
        raise AutopartError(
            f"no plan of {shape.name or 'the model'} ({shape.count()} parameters) "
            f"fits {cl.name} ({_gib(usable)} usable per GPU) "
            f"on {gpus} GPUs",
            hint=f"the smallest was {smallest}; use more GPUs or a smaller model",
        )
    _explain(ranked)
    stats["pruned_by_bound"] = stats["fitting_variants"] - stats["simulated"]
    stats["seconds"] = time.perf_counter() - t0
    rejected.sort(key=lambda x: x[0])
    return Search(ranked, stats, [text for _, text in rejected[:3]])


def memory_need(shape: GPTShape, cluster: Cluster | str, st: Plan) -> float:
    """Bytes the fullest pipeline rank of ``st`` needs (static state + activation peak)."""
    costs = CostModel(shape, load_cluster(cluster), st)
    return max(
        sum(costs.static_bytes(r).values()) + _activation_peak(costs, r) for r in range(st.pp)
    )


def fitting_alternatives(
    shape: GPTShape, cluster: Cluster | str, st: Plan, limit: int = 3
) -> list[tuple[Plan, float]]:
    """Plans one change away from ``st`` on the same GPUs that fit the cluster's memory, with
    their need in bytes, fewest bytes first: a memory saver turned on (recompute, sequence
    parallelism, the distributed optimizer), half the micro-batch, or twice the pp or tp (from
    dp). For the error ``autopart simulate`` gives a plan that does not fit."""
    cl = load_cluster(cluster)
    changes: list[dict[str, Any]] = [
        {"recompute": rc}
        for rc in ("selective", "full")
        if rc != st.recompute and st.recompute != "full"
    ]
    if st.tp > 1 and not st.sequence_parallel:
        changes.append({"sequence_parallel": True})
    if st.dp > 1 and not st.distributed_optimizer:
        changes.append({"distributed_optimizer": True})
    if (st.micro_batch or 1) > 1:
        changes.append({"micro_batch": (st.micro_batch or 1) // 2})
    if st.dp % 2 == 0:
        changes += [{"pp": st.pp * 2, "dp": st.dp // 2}, {"tp": st.tp * 2, "dp": st.dp // 2}]
    found = []
    for change in changes:
        try:
            alt = st.changed(**change)
            if alt.tp > cl.gpus_per_node:
                continue
            need = memory_need(shape, cl, alt)
        except AutopartError:
            continue
        if need <= cl.usable_bytes:
            found.append((alt, need))
    return sorted(found, key=lambda x: x[1])[:limit]


def _static_peak(shape: GPTShape, st: Plan) -> float:
    """Parameters + gradients + optimizer state of the rank holding the most parameters."""
    _, ranks = stage_params(shape, st)
    per = 6 + 12 / (st.dp if st.distributed_optimizer else 1)
    return per * max(ranks)


def _knobs(st: Plan) -> str:
    bits = [f"recompute={st.recompute}"]
    if st.tp > 1:
        bits.append("SP" if st.sequence_parallel else "no SP")
    if st.dp > 1:
        bits.append("dist-opt" if st.distributed_optimizer else "no dist-opt")
    return ", ".join(bits)


_CATS = {
    "compute_s": "compute",
    "tp_comm_s": "tp comm",
    "pp_comm_s": "pp comm",
    "dp_comm_s": "dp comm",
    "optimizer_s": "optimizer",
    "bubble_s": "bubble",
}


def _actions_per_rank(plan: Plan) -> int:
    """The most schedule actions (compute, sends, receives, reductions) any rank of ``plan``
    runs in a step."""
    return _action_count(
        plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages, plan.seq_chunks, plan.dp > 1
    )


@cache  # the near-tie sort and the reasons ask again for the same schedules
def _action_count(schedule: str, pp: int, m: int, v: int, k: int, dp: bool) -> int:
    return max(len(a) for a in _actions(schedule, pp, m, v, k, dp, False).values())


def _break_near_ties(ranked: list[Ranked]) -> list[Ranked]:
    """``ranked`` (fastest first) with each near tie ordered by memory, then by actions per
    rank, least first: a group is a plan and the slower ones within ``NEAR_TIE`` of it; groups
    keep their order."""
    out: list[Ranked] = []
    i = 0
    while i < len(ranked):
        limit = ranked[i].summary.iteration_s * (1 + NEAR_TIE)
        j = i + 1
        while j < len(ranked) and ranked[j].summary.iteration_s <= limit:
            j += 1
        group = ranked[i:j]
        if len(group) > 1:
            group.sort(
                key=lambda r: (
                    r.summary.memory_gb_per_gpu,
                    _actions_per_rank(r.plan),
                    r.summary.iteration_s,
                )
            )
        out += group
        i = j
    return out


def _explain(ranked: list[Ranked]) -> None:
    """Fill each plan's reason: what the winner saves over the runner-up; what each other plan
    loses to the winner, by breakdown category (differences under 0.1 % of an iteration are
    left out)."""
    best = ranked[0]
    eps = 1e-3 * best.summary.iteration_s

    def deltas(a: Ranked, b: Ranked) -> list[tuple[float, str]]:
        return sorted(
            ((a.summary.breakdown[k] - b.summary.breakdown[k], name) for k, name in _CATS.items()),
            reverse=True,
        )

    def gib(r: Ranked) -> str:
        return f"{r.summary.memory_gb_per_gpu:.2f} GiB"

    def tie_break(a: Ranked, b: Ranked) -> str:
        """What sets ``a`` apart from ``b`` in a near tie, as the reasons print it."""
        if gib(a) != gib(b):
            return f"needs {gib(a)} against {gib(b)}"
        return (
            f"as much memory, {_actions_per_rank(a.plan)} actions a rank against "
            f"{_actions_per_rank(b.plan)}"
        )

    fastest = min(ranked, key=lambda r: r.summary.iteration_s)
    if fastest is not best:
        behind = best.summary.iteration_s / fastest.summary.iteration_s - 1
        best.reason = (
            f"a near tie ({behind:.1%} behind #{ranked.index(fastest) + 1}, within "
            f"{NEAR_TIE:.0%}): {tie_break(best, fastest)}"
        )
    elif len(ranked) > 1:
        more = [f"{name} +{_secs(d)}" for d, name in deltas(ranked[1], best)[:2] if d > eps]
        ahead = ranked[1].summary.iteration_s / best.summary.iteration_s - 1
        best.reason = (
            f"fastest; {ahead:.1%} ahead of #2, which spends "
            f"{' and '.join(more) or 'about the same in every category'}"
        )
    else:
        best.reason = "fastest"
    for row in ranked[1:]:
        slower = row.summary.iteration_s / best.summary.iteration_s - 1
        if slower < 0:  # in #1's near tie: faster, but more memory or more actions
            row.reason = f"{-slower:.1%} faster than #1 (a near tie), but {tie_break(row, best)}"
            continue
        loss = deltas(row, best)
        more = [f"{name} +{_secs(d)}" for d, name in loss[:2] if d > eps]
        less = [f"{name} {_secs(-d)}" for d, name in loss[::-1][:1] if d < -eps]
        text = f"{slower:.1%} slower than #1: {', '.join(more) or 'small differences'}"
        row.reason = text + (f" (saves {less[0]})" if less else "")


def _secs(x: float) -> str:
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.1f} ms"


class _Progress:
    """A rich progress display, or nothing."""

    def __init__(self, on: bool, console: Any) -> None:
        self.bar = None
        if on:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console or Console(stderr=True),
                transient=False,
            )

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def add(self, text: str, total: int) -> int:
        return self.bar.add_task(text, total=total) if self.bar is not None else 0

    def advance(self, task: int) -> None:
        if self.bar is not None:
            from rich.progress import TaskID

            self.bar.advance(TaskID(task))

    def finish(self, task: int) -> None:
        if self.bar is not None:
            from rich.progress import TaskID

            done = self.bar.tasks[task].completed
            self.bar.update(
                TaskID(task),
                total=done,
                completed=done,
                description=self.bar.tasks[task].description + " (rest pruned)",
            )


def print_search(result: Search, console: Any) -> None:
    """The top plans as a rich table, each one's reason under it, then what the search did."""
    from rich.table import Table

    table = Table(title="fastest plans that fit")
    for col in ("#", "plan", "iteration", "tokens/s", "TFLOP/s/GPU", "MFU", "bubble", "memory"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for i, row in enumerate(result.ranked, 1):
        s = row.summary
        table.add_row(
            str(i),
            row.plan.describe(),
            _secs(s.iteration_s),
            f"{s.tokens_per_s:,.0f}",
            f"{s.tflops_per_gpu:.1f}",
            f"{s.mfu:.1%}",
            f"{s.bubble_fraction:.1%}",
            f"{s.memory_gb_per_gpu:.1f} GiB",
        )
    console.print(table)
    for i, row in enumerate(result.ranked, 1):
        console.print(f"#{i}: {row.reason}" + "".join(f"\n    {n}" for n in row.notes))
    st = result.stats
    console.print(
        f"{st['layouts']} layouts, {st['variants']} plans costed, {st['too_big']} "
        f"did not fit; {st['fitting_variants']} plans ({st['fitting_layouts']} layouts) "
        f"fit, {st['simulated']} simulated, {st['pruned_by_bound']} pruned by their "
        f"lower bound; {st['seconds']:.1f} s"
    )
    for text in result.rejected:
        console.print(f"closest miss: {text}")


__all__ = ["Ranked", "Search", "layouts", "print_search", "search"]
