"""dropout_rng: after this pass every active dropout is ``autopart::dropout`` with explicit seeds.

Invariant: no ``aten.dropout`` is left. A dropout with p = 0 or in eval mode is removed (it is
the identity). Every other becomes ``autopart::dropout(x, p, rng_seed, slot, rank)``: ``slot`` is
unique per dropout in the model, ``rng_seed`` is a graph input (``InputRef("rng", "seed")``)
the runtime sets per step, micro-batch and data-parallel rank, and ``rank`` is the ``tp_rank``
input for values split over tp (per-head attention probabilities, sequence-parallel
activations: independent masks) or None for replicated values (the same mask on every tp rank,
so replicated activations stay identical across the group). Masks are recomputed in backward.
"""

from __future__ import annotations

import torch
from torch import fx

from autopart import collectives  # noqa: F401 - registers autopart::dropout
from autopart.frontend.capture import InputRef
from autopart.frontend.shapes import fake_mode, propagate
from autopart.layout import Plan
from autopart.meta import (
    META_DROPOUT_SPLIT,
    META_INPUT,
    META_LAYER,
    META_MODULE,
    META_SEQ,
    META_TP_SPLIT,
)

aten, ops = torch.ops.aten, torch.ops.autopart
META_SPLIT = (META_TP_SPLIT, META_SEQ)  # set by tensor_/sequence_parallel


def dropout_rng(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    drops = [n for n in gm.graph.nodes if n.target == aten.dropout.default]
    active = [n for n in drops if n.args[1] > 0 and n.args[2]]
    for n in drops:
        if n not in active:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    if not active:
        return gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    rank = next((n for n in placeholders if n.meta[META_INPUT].kind == "rank"), None)
    with gm.graph.inserting_after(placeholders[-1]):
        seed = gm.graph.placeholder("rng_seed")
    seed.meta.update({META_INPUT: InputRef("rng", "seed"), META_MODULE: "", META_LAYER: None})
    with fake_mode([placeholders[-1].meta["val"]]):
        seed.meta["val"] = torch.empty((), dtype=torch.int64)
    for slot, n in enumerate(active):
        split = any(k in n.args[0].meta or k in n.meta for k in META_SPLIT)
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(
                ops.dropout.default,
                (n.args[0], float(n.args[1]), seed, slot, rank if split else None),
            )
        new.meta.update(n.meta)
        new.meta[META_DROPOUT_SPLIT] = split
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
    return propagate(gm)
