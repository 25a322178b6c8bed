"""data_parallel: after this pass every parameter placeholder has ``meta["autopart.dp_bucket"]``.

The value is the index of the gradient bucket the parameter's gradient is all-reduced in over
the data-parallel group (``None`` when dp = 1: nothing to reduce; ``None`` too for a parameter
the graph never reads: its gradient stays ``None``, as on one device, where torch's optimizers
skip it — a zero gradient would still take AdamW's weight decay). Buckets are numbered in the
order backward finishes their gradients — the reverse of each parameter's first use in the
forward graph — and each holds at most ``plan.bucket_mb`` MiB unless one parameter alone is
larger. The runtime launches bucket ``i``'s all-reduce as soon as its last gradient is ready,
so reductions overlap with the rest of the backward pass.
"""

from __future__ import annotations

from torch import fx

from autopart.layout import Plan
from autopart.meta import META_BUCKET, META_INPUT, META_STAGES


def data_parallel(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    for name in gm.meta.get(META_STAGES, []):  # a pipeline: bucket each stage on its own
        _bucket(getattr(gm, name), plan)
    return gm if gm.meta.get(META_STAGES) else _bucket(gm, plan)


def _bucket(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    params = [n for n in gm.graph.nodes if n.op == "placeholder" and _is_param(n)]
    for p in params:
        p.meta[META_BUCKET] = None
    params = [p for p in params if p.users]
    if plan.mesh.dp == 1:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_use = {p: min((order[u] for u in p.users), default=len(order)) for p in params}
    ready = sorted(params, key=lambda p: -first_use[p])  # gradients complete in reverse order
    limit = plan.bucket_mb * 2**20
    bucket, size = 0, 0.0
    for p in ready:
        val = p.meta["val"]
        nbytes = val.numel() * val.element_size()
        if size and size + nbytes > limit:
            bucket, size = bucket + 1, 0.0
        p.meta[META_BUCKET] = bucket
        size += nbytes
    return gm


def _is_param(node: fx.Node) -> bool:
    ref = node.meta.get(META_INPUT)
    return ref is not None and ref.kind == "param"


def buckets(gm: fx.GraphModule) -> list[list[str]]:
    """The parameter FQNs of each bucket, in bucket order (empty when dp = 1)."""
    out: dict[int, list[str]] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get(META_BUCKET) is not None:
            out.setdefault(n.meta[META_BUCKET], []).append(n.meta[META_INPUT].name)
    return [out[i] for i in sorted(out)]
