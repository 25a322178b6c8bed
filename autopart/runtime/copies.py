"""Copies agree: a parameter held by several ranks starts with the same bits on each, or the
run is refused before its first step.

Three kinds of copies exist: data-parallel replicas (every rank of a dp group holds the same
shards), tensor-parallel ranks holding a parameter tp does not split (norms, biases), and pipeline
ranks holding a tied parameter (an embedding and the LM head on different stages). Copies
that differ train on silently: the dp replicas drift apart, or the two ends of a tied weight
stop being one weight. They can differ because ranks built the model with different seeds,
because a file was damaged or edited, or because a NaN went into one copy.

``check_copies`` takes a fingerprint of every local parameter: its bits read as integers,
summed with weights that depend on position, so a permutation changes it too. It all-reduces
the fingerprints' maximum and minimum over each group of copies; where the two differ, the
copies differ. It also refuses a parameter that is not finite on some rank. The groups are
taken in one global order (dp, then tp, then the tie groups sorted), so no two ranks wait on
each other's groups crosswise. The cost is two small collectives per group, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autopart.errors import AutopartError, wait

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements fingerprinted at a time: bounds the int64 copy


def fingerprint(t: torch.Tensor) -> int:
    """A position-sensitive checksum of ``t``'s bits (the same bits give the same number)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.view(_BITS[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start : start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + part.numel(), device=flat.device, dtype=torch.int64)
        total += (part * (pos % 1_000_003 + 1)).sum()  # wraps around on overflow, the same way
    return int(total)


def _differ(values: Sequence[int], group: Any, timeout_s: float, what: str) -> list[bool]:
    """Which of ``values`` are not the same on every rank of ``group``."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    hi, lo = t.clone(), t.clone()
    rank = dist.get_rank()
    for x, op in ((hi, dist.ReduceOp.MAX), (lo, dist.ReduceOp.MIN)):
        wait(dist.all_reduce(x, op=op, group=group, async_op=True), rank, what, timeout_s)
    return (hi != lo).tolist()


def check_copies(
    params: Mapping[str, torch.Tensor],
    replicated: set[str],
    groups: dict[Any, Any],
    ties: Sequence[tuple[str, Any]],
    rank_lists: dict[str, list[int]],
    timeout_s: float,
) -> None:
    """Refuse the run if any copy of a parameter differs from the others, or is not finite.

    ``params``: this rank's parameters by FQN; ``replicated``: those tp does not split;
    ``groups``: this rank's process groups ("dp", "tp"; None where the dim has one rank);
    ``ties``: (FQN, tie group) of each tied parameter this rank holds; ``rank_lists``: the
    global ranks of this rank's dp and tp groups, for the message."""
    rank = dist.get_rank()
    for fqn, p in sorted(params.items()):
        if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all()):
            raise AutopartError(
                f"rank {rank}: parameter {fqn} holds NaN or inf before the first step",
                hint="the weights are damaged: rebuild the model, or resume from an intact "
                "checkpoint",
            )
    prints = {f: fingerprint(p) for f, p in params.items()}
    checks: list[tuple[str, Any, list[str]]] = []
    for dim, kind in (("dp", "data-parallel replicas"), ("tp", "tensor-parallel ranks")):
        if groups.get(dim) is not None:
            names = sorted(params) if dim == "dp" else sorted(f for f in params if f in replicated)
            who = rank_lists.get(dim, [])
            checks.append((f"{kind} (ranks {who})", groups[dim], names))
    by_group: dict[int, tuple[Any, list[str]]] = {}
    for fqn, group in ties:
        by_group.setdefault(id(group), (group, []))[1].append(fqn)
    for group, names in sorted(
        by_group.values(), key=lambda g: tuple(dist.get_process_group_ranks(g[0]))
    ):
        ranks = dist.get_process_group_ranks(group)
        checks.append((f"pipeline ranks sharing a tied weight (ranks {ranks})", group, names))
    for kind, group, names in checks:
        bad = _differ([prints[f] for f in names], group, timeout_s, f"checking {kind} agree")
        wrong = [f for f, b in zip(names, bad, strict=True) if b]
        if wrong:
            raise AutopartError(
                f"rank {rank}: parameter {wrong[0]} differs between {kind}"
                + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""),
                hint="every copy must start equal: build the model with the same seed on every "
                "rank (torch.manual_seed before constructing it), or load the same weights",
            )
