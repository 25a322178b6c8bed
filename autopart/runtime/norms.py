"""The global gradient norm of a parallel model, and clipping by it, equal to one device's.

Every parameter of the model counts once, wherever its copies and pieces live:

- a tp-split parameter: each tp rank holds a slice, and the squares add up over the tp group;
- a parameter tp does not split: every tp rank holds it whole; tp rank 0 counts it;
- a tied parameter held by several pipeline ranks (the embedding and the LM head): the lowest
  of those pipeline ranks counts it;
- data-parallel replicas hold the same reduced gradients: each counts the same sum, and none is
  added to another.

The local sums are all-reduced over the tp group, then over the pp group. Both reductions give
every member the same bits, so every rank of the job computes the same norm and the same clip
factor (torch's ``clip_grad_norm_`` on each rank's shards gives each tp rank a different norm,
and the replicated weights drift apart). The sums are in float64, and the clip factor follows
``torch.nn.utils.clip_grad_norm_``: ``max_norm / (norm + 1e-6)``, applied only below 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from autopart.errors import AutopartError, wait
from autopart.layout import Coords
from autopart.runtime import staging


def counted(
    params: Mapping[str, torch.Tensor],
    split: Mapping[str, bool],
    ties: Mapping[str, list[int]],
    coords: Coords,
) -> list[str]:
    """The parameters this rank counts in the global norm (module docstring)."""
    out = []
    for fqn in sorted(params):
        if not split[fqn] and coords.tp != 0:
            continue
        if fqn in ties and coords.pp != min(ties[fqn]):
            continue
        out.append(fqn)
    return out


def global_norm(
    params: Mapping[str, torch.Tensor],
    split: Mapping[str, bool],
    ties: Mapping[str, list[int]],
    coords: Coords,
    groups: Mapping[Any, Any],
    norm_type: float,
    timeout_s: float,
) -> float:
    """The norm of every gradient of the model (module docstring); None gradients are zero."""
    if norm_type <= 0:
        raise AutopartError(f"norm_type {norm_type} must be positive (2.0, or inf)")
    grads = [
        g.detach()
        for f in counted(params, split, ties, coords)
        if (g := params[f].grad) is not None
    ]
    device = next(iter(params.values())).device if params else torch.device("cpu")
    if math.isinf(norm_type):
        local = max((g.abs().max().double() for g in grads if g.numel()), default=None)
        total = torch.zeros((), dtype=torch.float64, device=device) if local is None else local
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            total = total + g.double().abs().pow(norm_type).sum()
    rank = dist.get_rank() if dist.is_initialized() else 0
    for dim in ("tp", "pp"):
        group = groups.get(dim)
        if group is None:
            continue
        what = f"the gradient norm over the {dim} group"
        if math.isinf(norm_type):
            t = total.cpu() if dist.get_backend(group) == "gloo" else total
            wait(
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True),
                rank,
                what,
                timeout_s,
            )
            total = t.to(device)
        else:
            wait(staging.all_reduce(total, group), rank, what, timeout_s)
    value = float(total)
    return value if math.isinf(norm_type) else value ** (1.0 / norm_type)


def clip_(params: Mapping[str, torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale every local gradient by ``max_norm / (norm + 1e-6)`` when that is below 1."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params.values():
            if p.grad is not None:
                p.grad.detach().mul_(coef)
