"""A stage graph's arguments: what feeds each placeholder, from its ``InputRef``.

The contract between a compiled program and whoever runs its stage graphs: the runtime
(``Runner``), the compile-time dry run (``lowering/dry_run.py``) and the memory probe
(``planning/memory.py``) all bind a stage's placeholders here, so the three cannot drift apart.
Each placeholder's ``InputRef`` (``StageProgram.inputs``) names its kind: a parameter, a buffer,
a batch tensor, this rank's coordinate, the previous stage's activation, a K/V prefix, the chunk
offset or the dropout seed. Nothing here runs a graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from autopart.layout import Coords


def stage_inputs(
    refs: Sequence[Any],
    *,
    params: Mapping[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    data: dict[str, torch.Tensor],
    coords: Coords,
    acts: Sequence[torch.Tensor],
    prefix: Sequence[torch.Tensor],
    offset: int,
    seed: torch.Tensor | None,
    compute: torch.dtype | None,
    device: torch.device,
) -> list[Any]:
    """A stage graph's arguments, one per placeholder (``refs``: its ``InputRef``s): parameters
    (cast to ``compute`` inside autograd under mixed precision), buffers, the batch, this rank's
    coordinates, the previous stage's activations, the K/V prefix, the chunk offset and the
    dropout seed."""
    out: list[Any] = []
    for ref in refs:
        if ref.kind == "act":
            out.append(acts[int(ref.name)])
        elif ref.kind == "param":
            p = params[ref.name]
            cast = compute is not None and p.is_floating_point()
            out.append(p.to(compute) if cast else p)
        elif ref.kind == "rank":
            out.append(torch.tensor(coords.along(ref.name), device=device))
        elif ref.kind == "rng":
            out.append(seed)
        elif ref.kind == "data":
            out.append(data[ref.name])
        elif ref.kind == "kv":
            out.append(prefix[int(ref.name)])
        elif ref.kind == "offset":
            out.append(torch.tensor(offset, device=device))
        else:
            out.append(buffers[ref.name])
    return out


__all__ = ["stage_inputs"]
