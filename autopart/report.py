"""Inspection: the per-block cost table, per-rank programs and Graphviz output."""

from __future__ import annotations

from pathlib import Path

import sympy
from rich.console import Console
from rich.table import Table
from torch import fx

from autopart.capture import META_LAYER, META_MODULE, Captured
from autopart.cost import Group, analyze, evaluate, total


def _human(x: float, unit: str = "") -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {suffix}{unit}"
    return f"{x:.0f} {unit}".strip()


def cost_table(captured: Captured, groups: list[Group] | None = None, b: int | None = None,
               s: int | None = None) -> Table:  # fmt: skip
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
            g.name, f"{g.params:,}", _human(evaluate(g.cost.flops, b, s)),
            _human(evaluate(g.cost.mm_flops, b, s)), _human(evaluate(g.cost.act_bytes, b, s), "B"),
            str(sympy.nsimplify(sympy.expand(g.cost.flops))),
        )  # fmt: skip
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


def module_of(node: fx.Node) -> str:
    return node.meta.get(META_MODULE, "")
