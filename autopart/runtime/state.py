"""The whole model's state from the ranks' pieces, and back: what ``Runner.full_state_dict``,
``load_full_state_dict`` and ``copy_to`` do.

Every rank holds the parameters of its stages, each whole or a tp slice (``Shard``), and the
buffers its stages read. ``full_state_dict`` gathers what the ranks of data-parallel index 0
hold to every rank (``all_gather_object`` over the world), puts the tp slices of each parameter
back together (``assemble``, the inverse of ``Shard.local``) and names everything as the model
does: tied aliases point at their canonical tensor, and when the model's own state-dict keys are
known (the live API records them), exactly those keys, so the result loads strictly into the
original model. ``load_full_state_dict`` is local: each rank cuts its slices from the full
tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from autopart.errors import AutopartError
from autopart.layout import Coords
from autopart.program.format import Shard


def assemble(shard: Shard, pieces: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The global tensor from its tp slices (index → slice): the inverse of ``Shard.local``."""
    if shard.dim is None:
        return next(iter(pieces.values()))
    if sorted(pieces) != list(range(shard.parts)):
        raise AutopartError(
            f"the slices of a parameter of shape {shard.shape} are incomplete: got "
            f"{sorted(pieces)} of {shard.parts}"
        )
    blocks = [pieces[i].chunk(shard.strided, shard.dim) for i in range(shard.parts)]
    return torch.cat(
        [
            torch.cat([blocks[i][b] for i in range(shard.parts)], shard.dim)
            for b in range(shard.strided)
        ],
        shard.dim,
    )


def gather_full(
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    shards: Mapping[str, Shard],
    coords: Coords,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every parameter (assembled) and buffer of the model, on the CPU, on every rank.
    Collective over the whole job."""
    mine: dict[str, Any] = {"params": {}, "buffers": {}}
    if coords.dp == 0:  # one replica speaks for all
        mine["params"] = {f: (shards[f], p.detach().cpu()) for f, p in params.items()}
        mine["buffers"] = {k: v.detach().cpu() for k, v in buffers.items()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    pieces: dict[str, tuple[Shard, dict[int, torch.Tensor]]] = {}
    out_buffers: dict[str, torch.Tensor] = {}
    for part in every:
        for fqn, (shard, t) in part["params"].items():
            pieces.setdefault(fqn, (shard, {}))[1][shard.index if shard.dim is not None else 0] = t
        out_buffers.update(part["buffers"])
    full = {fqn: assemble(shard, ps) for fqn, (shard, ps) in pieces.items()}
    return full, out_buffers


def model_state(
    full: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    tied: Mapping[str, str],
    keys: list[str] | None,
) -> dict[str, torch.Tensor]:
    """The state dict under the model's own names: parameters, their tied aliases, buffers;
    only ``keys`` (the model's ``state_dict()`` keys) when given, every one of them present."""
    sd: dict[str, torch.Tensor] = {**buffers, **full}
    for alias, canonical in tied.items():
        if canonical in full:
            sd[alias] = full[canonical]
    if keys is None:
        return sd
    missing = [k for k in keys if k not in sd]
    if missing:
        raise AutopartError(
            f"the ranks hold no value for {len(missing)} entries of the model's state dict "
            f"(e.g. {missing[0]})",
            hint="please report this with the model",
        )
    return {k: sd[k] for k in keys}


class Loaded(NamedTuple):
    """What ``Runner.load_state_dict`` returns, as ``nn.Module.load_state_dict`` does."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_local(
    sd: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    shards: Mapping[str, Shard],
    tied: Mapping[str, str],
    strict: bool = True,
) -> list[str]:
    """Copy this rank's slices of a full state dict into its parameters and buffers; returns
    the parameters ``sd`` has no value for (``strict``: refused if any). A tensor of a tp
    slice's shape rather than the whole one is refused: which rank's slice it is cannot be
    told, and another rank's would train a wrong model."""
    by_canonical = {canonical: alias for alias, canonical in tied.items()}
    missing = []
    with torch.no_grad():
        for fqn, p in params.items():
            full = sd.get(fqn, sd.get(by_canonical.get(fqn, ""), None))
            if full is None:
                missing.append(fqn)
                continue
            if tuple(full.shape) != tuple(shards[fqn].shape):
                piece = tuple(full.shape) == tuple(p.shape)
                raise AutopartError(
                    f"{fqn}: the state dict holds shape {tuple(full.shape)}, the model "
                    f"{tuple(shards[fqn].shape)}"
                    + (
                        ": a tp rank's slice (a Runner.state_dict()), not the whole tensor"
                        if piece
                        else ""
                    ),
                    hint="load the whole model's state dict (Runner.full_state_dict(), or the "
                    "model's own); autopart.checkpoint saves and loads sharded checkpoints"
                    if piece
                    else "load a state dict of this model",
                )
            p.copy_(shards[fqn].local(full.to(p.device, p.dtype)))
        for name, b in buffers.items():
            if name in sd:
                b.copy_(sd[name].to(b.device, b.dtype))
    if missing and strict:
        raise AutopartError(
            f"the state dict has no {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            hint="pass the model's full state dict (Runner.full_state_dict() or model.state_dict())",
        )
    return missing
