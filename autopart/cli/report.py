"""Inspection: the per-block cost table, per-rank programs and Graphviz output."""

from __future__ import annotations

from pathlib import Path

import sympy
import torch
from rich.console import Console
from rich.table import Table
from torch import fx

from autopart.frontend.capture import Captured, to_sympy
from autopart.frontend.cost import Group, analyze, evaluate, total
from autopart.meta import META_LAYER


def _human(x: float, unit: str = "") -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {suffix}{unit}"
    return f"{x:.0f} {unit}".strip()


def cost_table(
    captured: Captured,
    groups: list[Group] | None = None,
    b: int | None = None,
    s: int | None = None,
) -> Table:
    """Per-block parameters, forward FLOPs and activation bytes, as numbers and formulas."""
    groups = groups if groups is not None else analyze(captured)
    b = b or captured.example_shape[0]
    s = s or captured.example_shape[1]
    t = Table(title=f"cost per block (forward, at batch {b}, sequence {s})")
    for col in ("block", "params", "FLOPs", "matmul FLOPs", "activations", "FLOPs formula (b, s)"):
        t.add_column(col, justify="left" if col in ("block", "FLOPs formula (b, s)") else "right")
    for g in [
        *groups,
        Group("total", None, sum(g.params for g in groups), total(g.cost for g in groups)),
    ]:
        t.add_row(
            g.name,
            f"{g.params:,}",
            _human(evaluate(g.cost.flops, b, s)),
            _human(evaluate(g.cost.mm_flops, b, s)),
            _human(evaluate(g.cost.act_bytes, b, s), "B"),
            str(sympy.nsimplify(sympy.expand(g.cost.flops))),
        )
    return t


def print_costs(captured: Captured, console: Console | None = None) -> list[Group]:
    groups = analyze(captured)
    (console or Console()).print(cost_table(captured, groups))
    return groups


def to_dot(gm: fx.GraphModule, title: str = "") -> str:
    """Graphviz DOT text of a graph: one box per node, clustered by transformer block."""
    lines = [
        "digraph autopart {",
        "  rankdir=TB;",
        '  node [shape=box, fontname="monospace", fontsize=9];',
    ]
    if title:
        lines.append(f'  label="{title}"; labelloc=t;')
    clusters: dict[object, list[str]] = {}
    for n in gm.graph.nodes:
        target = getattr(n.target, "__name__", str(n.target)) if n.op == "call_function" else n.op
        val = n.meta.get("val")
        shape = f"\\n{list(val.shape)}" if hasattr(val, "shape") else ""
        label = f"{n.name}\\n{target}{shape}".replace('"', "'")
        clusters.setdefault(n.meta.get(META_LAYER), []).append(f'    "{n.name}" [label="{label}"];')
    for layer, nodes in clusters.items():
        if layer is None:
            lines += [x[2:] for x in nodes]
        else:
            lines += [
                f"  subgraph cluster_{layer} {{",
                f'    label="block {layer}";',
                *nodes,
                "  }",
            ]
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{n.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_dot(gm: fx.GraphModule, path: str | Path, title: str = "") -> Path:
    p = Path(path)
    p.write_text(to_dot(gm, title))
    return p


_COLLECTIVES = {
    "tp_copy": "f: identity fwd / all-reduce bwd",
    "tp_reduce": "g: all-reduce fwd / identity bwd",
    "tp_gather": "all-gather fwd / reduce-scatter bwd",
    "tp_scatter_reduce": "reduce-scatter fwd / all-gather bwd",
    "tp_split": "own chunk fwd / all-gather bwd",
    "tp_join": "all-gather fwd / own chunk bwd",
    "tp_all_reduce_grad": "all-reduce of the gradient",
    "vocab_parallel_ce": "1 all-gather of \\[3, b·s] (max, sum exp, target); bytes: local logits",
}


def parallel_table(rp, example_shape: tuple[int, int]) -> Table:
    """Per block: each split parameter (global → local shape, dim, strided) and each collective
    (kind, group, bytes at the example shape)."""
    b, s = example_shape
    t = Table(
        title=f"rank {rp.rank}: split parameters and collectives per block (bytes at b={b}, s={s})"
    )
    for col in ("block", "what", "name", "detail"):
        t.add_column(col)
    for st in rp.stages:
        gm = st.graph
        rows: dict[object, list[tuple[str, str, str]]] = {}
        for fqn, shard in rp.shards.items():
            if shard.dim is not None:
                local = tuple(shard.local(torch.empty(shard.shape, device="meta")).shape)
                how = f"{shard.shape} → {local}, dim {shard.dim}" + (
                    f", strided ×{shard.strided}" if shard.strided > 1 else ""
                )
                rows.setdefault(_layer_of_fqn(fqn), []).append(("param", fqn, how))
        for n in gm.graph.nodes:
            name = getattr(n.target, "_opname", None) if n.op == "call_function" else None
            if getattr(n.target, "namespace", None) != "autopart" or name not in _COLLECTIVES:
                continue
            val = n.args[0].meta.get("val") if hasattr(n.args[0], "meta") else None
            size = ""
            if val is not None and hasattr(val, "shape"):
                numel: float = 1
                for d in val.shape:
                    numel *= int(d) if not hasattr(d, "node") else evaluate(to_sympy(d, gm), b, s)
                size = f", {_human(numel * val.element_size(), 'B')}"
            group = next((a for a in n.args if isinstance(a, str)), "?")
            rows.setdefault(n.meta.get(META_LAYER), []).append(
                ("collective", f"{name}({group})", f"{_COLLECTIVES[name]}{size}")
            )
        for layer in sorted(rows, key=lambda x: (x is not None, x if x is not None else -1)):
            for what, name, detail in rows[layer]:
                t.add_row("-" if layer is None else f"block {layer}", what, name, detail)
    return t


def _layer_of_fqn(fqn: str) -> int | None:
    from autopart.frontend.capture import layer_of

    return layer_of(fqn)


def balance_table(program) -> Table | None:
    """Per-stage forward+backward FLOPs of autopart's split against an equal-blocks split."""
    from autopart.passes.pipeline_split import equal_block_cuts, imbalance, stage_costs

    if not program.split:
        return None
    cost, cuts = program.split["unit_costs"], program.split["cuts"]
    auto = stage_costs(cost, cuts)
    equal = stage_costs(cost, equal_block_cuts(len(cost), len(auto)))
    t = Table(
        title="pipeline stages: forward+backward FLOPs per micro-batch (max/mean: 1.00 is perfect)"
    )
    for col in ("split", *(f"stage {k}" for k in range(len(auto))), "max/mean"):
        t.add_column(col, justify="left" if col == "split" else "right")
    names = ["embed", *(f"b{i}" for i in range(len(cost) - 2)), "head"]
    bounds = [0, *cuts, len(cost)]
    label = " | ".join(",".join(names[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    t.add_row(
        f"autopart (cost model): {label}", *(_human(c) for c in auto), f"{imbalance(auto):.3f}"
    )
    t.add_row("equal blocks per stage", *(_human(c) for c in equal), f"{imbalance(equal):.3f}")
    return t


def chunk_rich(captured: Captured, seq_len: int, k: int, multiple: int = 8) -> Table:
    """Seq1F1B chunk boundaries and each chunk's forward FLOPs, balanced against uniform."""
    from autopart.lowering.chunks import chunk_table

    t = Table(
        title=f"Seq1F1B: {k} chunks of a {seq_len}-token sequence (forward FLOPs per chunk, b=1)"
    )
    for col in ("split", "chunk lengths", "chunk FLOPs", "max/min"):
        t.add_column(col, justify="right" if col == "max/min" else "left")
    for row in chunk_table(captured, seq_len, k, multiple):
        t.add_row(
            row["split"],
            str(row["lengths"]),
            ", ".join(_human(c) for c in row["costs"]),
            f"{row['max_over_min']:.4f}",
        )
    return t
