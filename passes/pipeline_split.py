"""pipeline_split: after this pass the graph is a pipeline of ``pp·v`` stage graphs.

Invariant (pp·v > 1): the returned GraphModule's graph calls submodules ``stage0 … stageK`` in
order, and running it equals running the unsplit graph. Every node of the model is in exactly
one stage (never a dropped layer); cuts fall between transformer blocks, chosen by a dynamic
program that minimizes the most expensive stage's forward+backward FLOPs (embedding, LM head
and loss included) at the example shape. Each stage's placeholders carry ``InputRef``: the
parameters, buffers and batch tensors it uses, then ``InputRef("act", i)`` for the values
that cross the cut before it. Stage k's outputs are exactly stage k+1's ``act`` inputs (a
value needed two stages later is relayed), so activations only move between neighbours.
``stage.meta["autopart.stage"]`` is its index; model chunk i runs on pipeline rank i mod pp.

Recompute rule: a value that depends on no activation — only on parameters, buffers, the
batch tensors or rank/seed inputs (positions from ``arange``, masks, rotary tables, the
``tp_all_reduce_grad`` of a parameter) — is not sent: every stage that uses it computes its own
copy. A parameter used by two stages (GPT-2's tied ``wte``/``lm_head``) is an input of both;
the runtime sums its gradient over the ranks that hold it.
"""

from __future__ import annotations

import math

import networkx as nx
import torch
from torch import fx

from autopart.errors import AutopartError
from autopart.frontend.capture import B, InputRef, S
from autopart.frontend.cost import node_cost
from autopart.layout import Plan
from autopart.meta import (
    META_CUTS,
    META_EXAMPLE_SHAPE,
    META_INPUT,
    META_INPUTS,
    META_LAYER,
    META_MODULE,
    META_PASSES,
    META_STAGE,
    META_STAGES,
    META_UNIT_COSTS,
)


def pipeline_split(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    stages = plan.mesh.pp * plan.virtual_stages
    if stages == 1:
        return gm
    units, order = block_units(gm)
    n_units = max(units.values()) + 1
    if n_units - 2 == 0:
        raise AutopartError(
            f"pp({plan.mesh.pp}) * virtual_stages({plan.virtual_stages}) = {stages} stages, but "
            "the model has no transformer blocks to cut between: the pipeline cuts between "
            "modules whose path holds a layer index (transformer.h.3, model.layers.0), and no "
            "module here has one (one block applied several times with shared weights, or "
            "blocks that are not in a ModuleList / Sequential)",
            hint="keep the blocks in an nn.ModuleList, each with its own weights, to pipeline "
            "them; a model that reuses one block trains with dp and tp (pp=1)",
        )
    if stages > n_units - 2:
        raise AutopartError(
            f"pp({plan.mesh.pp}) * virtual_stages({plan.virtual_stages}) = {stages} stages, but the "
            f"model has {n_units - 2} transformer block{'s' if n_units - 2 != 1 else ''}",
            hint="use at most one stage per block: lower pp or virtual_stages",
        )
    cost = _unit_costs(gm, units, n_units, plan)
    limit = None if plan.max_stage_memory_gb is None else plan.max_stage_memory_gb * 2**30
    inflight = [min(plan.microbatches * plan.virtual_stages, stages - k) for k in range(stages)]
    cuts = balanced_cuts(cost, stages, _unit_memory(gm, units, n_units, plan), limit, inflight)
    stage_of = {n: _stage(units[n], cuts) for n in units}
    gm.meta[META_UNIT_COSTS] = cost
    gm.meta[META_CUTS] = cuts
    return _build(gm, stage_of, stages, order)


# -- where each node lives ------------------------------------------------------------------


_PARAM_VIEWS = frozenset({"tp_all_reduce_grad", "t", "view", "to", "_to_copy", "detach", "alias"})


def recomputable(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes computed by each stage that needs them instead of sent: values no parameter flows
    into (positions, masks, rotary tables, index arithmetic), and aliases of one parameter."""
    graph = nx.DiGraph()
    for n in gm.graph.nodes:
        graph.add_node(n)
        graph.add_edges_from((a, n) for a in n.all_input_nodes)
    params = [
        n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[META_INPUT].kind == "param"
    ]
    tainted = set(params).union(*(nx.descendants(graph, p) for p in params)) if params else set()
    out = {n for n in gm.graph.nodes if n.op == "call_function" and n not in tainted}
    for n in gm.graph.nodes:  # e.g. tp_all_reduce_grad(wpe): an alias of the parameter
        name = getattr(n.target, "_opname", getattr(n.target, "__name__", ""))
        alias = n.op == "call_function" and name in _PARAM_VIEWS and n.args and n.args[0] in params
        if alias and all(
            a in params or a in out or a.op == "placeholder" for a in n.all_input_nodes
        ):
            out.add(n)
    return out


def block_units(gm: fx.GraphModule) -> tuple[dict[fx.Node, int], list[fx.Node]]:
    """Unit of each non-recomputable call node: 0 = embedding, 1 + i = block i, last = head."""
    rec = recomputable(gm)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n not in rec]
    layers = sorted({n.meta.get(META_LAYER) for n in calls} - {None})
    index = {layer: i + 1 for i, layer in enumerate(layers)}
    last_block = max(
        (i for i, n in enumerate(calls) if n.meta.get(META_LAYER) is not None), default=-1
    )
    units, current = {}, 0
    for i, n in enumerate(calls):
        layer = n.meta.get(META_LAYER)
        if layer is not None:
            current = index[layer]
        elif i > last_block:
            current = len(layers) + 1
        units[n] = current
    return units, calls


def _unit_costs(
    gm: fx.GraphModule, units: dict[fx.Node, int], n_units: int, plan: Plan
) -> list[float]:
    """Forward + backward FLOPs (3 × forward) of each unit at the example shape."""
    b, s = gm.meta.get(META_EXAMPLE_SHAPE, (8, 128))
    cost = [0.0] * n_units
    for n, u in units.items():
        flops = node_cost(n, gm).flops
        cost[u] += (
            3 * float(flops.subs({B: max(1, b // plan.microbatches), S: s})) if flops != 0 else 0.0
        )
    return cost


def _unit_memory(
    gm: fx.GraphModule, units: dict[fx.Node, int], n_units: int, plan: Plan
) -> list[tuple[float, float]]:
    """(parameter bytes, activation bytes per micro-batch) of each unit at the example shape."""
    b, s = gm.meta.get(META_EXAMPLE_SHAPE, (8, 128))
    sizes = {B: max(1, b // plan.microbatches), S: s}
    out = [[0.0, 0.0] for _ in range(n_units)]
    seen: set[fx.Node] = set()
    for n, u in units.items():
        act = node_cost(n, gm).act_bytes
        out[u][1] += float(act.subs(sizes)) if act != 0 else 0.0
        for a in n.all_input_nodes:
            if a.op == "placeholder" and a.meta[META_INPUT].kind == "param" and a not in seen:
                seen.add(a)
                out[u][0] += a.meta["val"].numel() * a.meta["val"].element_size()
    return [(p, a) for p, a in out]


def balanced_cuts(
    cost: list[float],
    stages: int,
    memory: list[tuple[float, float]] | None = None,
    limit: float | None = None,
    inflight: list[int] | None = None,
) -> list[int]:
    """Split units into ``stages`` contiguous, non-empty runs minimizing the largest run's cost
    (ties: the smaller sum of squares). Returns the first unit of each stage after the first.

    With ``memory`` (per unit: parameter bytes, activation bytes per micro-batch) and ``limit``,
    a stage k must fit: 4 × its parameter bytes (weights, gradients, two Adam moments) +
    ``inflight[k]`` × its activation bytes ≤ ``limit``; no split fitting is an AutopartError."""
    n = len(cost)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    mem_p, mem_a = [0.0], [0.0]
    for p, a in memory or [(0.0, 0.0)] * n:
        mem_p.append(mem_p[-1] + p)
        mem_a.append(mem_a[-1] + a)

    def fits(k: int, i: int, j: int) -> bool:  # stage k - 1 holds units [i, j)
        if limit is None or memory is None:
            return True
        held = 4 * (mem_p[j] - mem_p[i]) + (inflight or [1] * stages)[k - 1] * (mem_a[j] - mem_a[i])
        return held <= limit

    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or not fits(k, i, j):
                    continue
                run = prefix[j] - prefix[i]
                cand = (max(best[k - 1][i][0], run), best[k - 1][i][1] + run * run)
                if cand < best[k][j]:
                    best[k][j], back[k][j] = cand, i
    if best[stages][n] == inf:
        if limit is None:  # no memory limit: only too few units leave no split
            raise AutopartError(f"{n} units cannot be cut into {stages} non-empty stages")
        most = max(4 * p + (max(inflight or [1])) * a for p, a in memory or [(0.0, 0.0)])
        raise AutopartError(
            f"no split of the model into {stages} stages fits {limit / 2**30:.3g} GiB per stage "
            f"(the largest single unit alone needs {most / 2**30:.3g} GiB with its in-flight activations)",
            hint="raise the memory limit, add pipeline stages, or use fewer micro-batches in flight",
        )
    cuts, j = [], n
    for k in range(stages, 0, -1):
        j = back[k][j]
        cuts.append(j)
    return sorted(cuts)[1:]


def equal_block_cuts(n_units: int, stages: int) -> list[int]:
    """The usual hand split, for comparison: the same number of blocks per stage (± 1), the
    embedding on the first stage and the LM head on the last."""
    blocks = n_units - 2
    return [1 + k * blocks // stages for k in range(1, stages)]


def stage_costs(cost: list[float], cuts: list[int]) -> list[float]:
    """Cost of each stage for unit costs ``cost`` cut at ``cuts``."""
    bounds = [0, *cuts, len(cost)]
    return [sum(cost[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def imbalance(costs: list[float]) -> float:
    """max / mean of the stage costs (1.0 is perfect balance)."""
    return max(costs) / (sum(costs) / len(costs)) if costs and sum(costs) else 1.0


def _stage(unit: int, cuts: list[int]) -> int:
    return sum(unit >= c for c in cuts)


# -- building the stage graphs --------------------------------------------------------------


def _build(
    gm: fx.GraphModule, stage_of: dict[fx.Node, int], stages: int, order: list[fx.Node]
) -> fx.GraphModule:
    rec = recomputable(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    crossing: list[list[fx.Node]] = []  # crossing[k]: values stage k hands to stage k + 1
    for k in range(stages - 1):
        vals = [
            n
            for n in order
            if stage_of[n] <= k
            and any(_user_stage(u, stage_of, output, stages) > k for u in n.users)
        ]
        crossing.append(vals)
    subs = [_stage_graph(gm, k, stage_of, rec, crossing, output, stages) for k in range(stages)]
    return _parent(gm, subs, crossing)


def _user_stage(u: fx.Node, stage_of: dict[fx.Node, int], output: fx.Node, stages: int) -> int:
    if u is output:
        return stages - 1
    if u in stage_of:
        return stage_of[u]
    return min(
        (_user_stage(x, stage_of, output, stages) for x in u.users), default=-1
    )  # recomputable


def _stage_graph(gm, k, stage_of, rec, crossing, output, stages) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    refs: list[InputRef] = []
    originals = [n for n in gm.graph.nodes if n.op == "placeholder"]
    needed = _needed(gm, k, stage_of, rec, crossing, output, stages)
    for p in originals:  # model inputs this stage reads, in the model's order
        if p in needed:
            env[p] = g.placeholder(p.name)
            env[p].meta.update(p.meta)
            refs.append(p.meta[META_INPUT])
    for i, v in enumerate(crossing[k - 1] if k else []):
        env[v] = g.placeholder(f"act_{v.name}")
        env[v].meta.update({key: val for key, val in v.meta.items() if key != META_INPUT})
        env[v].meta[META_INPUT] = InputRef("act", str(i))
        refs.append(env[v].meta[META_INPUT])
    for n in gm.graph.nodes:
        if (
            n.op == "get_attr"
            and n in needed
            or n.op == "call_function"
            and n in needed
            and n not in env
        ):
            env[n] = g.node_copy(n, lambda a: env[a])
    if k == stages - 1:
        g.output(fx.map_arg(output.args[0], lambda a: env[a]))
    else:
        g.output(tuple(env[v] for v in crossing[k]))
    sub = fx.GraphModule(gm, g)
    sub.meta.update(
        {kk: vv for kk, vv in gm.meta.items() if kk.startswith("autopart.") and kk != META_PASSES}
    )
    sub.meta[META_STAGE] = k
    sub.meta[META_INPUTS] = refs
    return sub


def _needed(gm, k, stage_of, rec, crossing, output, stages) -> set[fx.Node]:
    """Nodes stage k computes or reads: its own nodes, the recomputable values they use, the
    placeholders they read; values arriving from stage k − 1 are inputs, not computed here."""
    arriving = set(crossing[k - 1]) if k else set()
    roots = [n for n, s in stage_of.items() if s == k]
    if k == stages - 1:
        roots += [a for a in output.all_input_nodes]
    if k < stages - 1:
        roots += [v for v in crossing[k] if v not in arriving]
    need, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n in need or n in arriving:
            continue
        need.add(n)
        if n.op == "placeholder" or (n in stage_of and stage_of[n] != k):
            continue
        stack.extend(n.all_input_nodes)
    bad = [n for n in need if n in stage_of and stage_of[n] != k and n not in arriving]
    if bad:
        n = min(bad, key=lambda b: stage_of[b])
        user = next((u for u in n.users if u in need and stage_of.get(u, k) == k), n)
        raise AutopartError(
            f"pipeline stage {k} would need node {n.name} ({_where(n)}), computed in stage "
            f"{stage_of[n]}, for node {user.name} ({_where(user)}): the model does not run its "
            "blocks once each, in order (a later block's output feeds an earlier block, as in "
            "a model that loops over its blocks), so its graph is not a chain of stages",
            hint="use dp and tp for this model (no pp)",
        )
    return need


def _where(n: fx.Node) -> str:
    return n.meta.get(META_MODULE) or "<root>"


def _parent(
    gm: fx.GraphModule, subs: list[fx.GraphModule], crossing: list[list[fx.Node]]
) -> fx.GraphModule:
    """A graph that calls the stages in order: running it runs the whole model."""
    g = fx.Graph()
    root = torch.nn.Module()
    env: dict[str, fx.Node] = {}
    for p in gm.graph.nodes:
        if p.op == "placeholder":
            env[p.name] = g.placeholder(p.name)
            env[p.name].meta.update(p.meta)
    acts: list[fx.Node] = []
    out = None
    for k, sub in enumerate(subs):
        setattr(root, f"stage{k}", sub)
        args = []
        for ref, ph in zip(
            sub.meta[META_INPUTS],
            (n for n in sub.graph.nodes if n.op == "placeholder"),
            strict=True,
        ):
            args.append(acts[int(ref.name)] if ref.kind == "act" else env[ph.name])
        call = g.call_module(f"stage{k}", tuple(args))
        if k < len(subs) - 1:
            acts = [g.call_function(_getitem, (call, i)) for i in range(len(crossing[k]))]
        out = call
    g.output(out)
    parent = fx.GraphModule(root, g)
    parent.meta.update(gm.meta)
    parent.meta[META_STAGES] = [f"stage{k}" for k in range(len(subs))]
    return parent


def _getitem(x, i):
    return x[i]


def stage_graphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The stage graphs of a split graph, in order (``[gm]`` when not split)."""
    names = gm.meta.get(META_STAGES)
    return [getattr(gm, n) for n in names] if names else [gm]


__all__ = [
    "META_STAGE",
    "balanced_cuts",
    "block_units",
    "equal_block_cuts",
    "imbalance",
    "pipeline_split",
    "recomputable",
    "stage_costs",
    "stage_graphs",
]
