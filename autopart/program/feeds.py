"""A stage graph's arguments: what feeds each placeholder, from its ``InputRef``.

The contract between a compiled program and whoever runs its stage graphs: the runtime
(``Runner``), the compile-time dry run (``lowering/dry_run.py``) and the memory probe
(``planning/memory.py``) all bind a stage's placeholders here, so the three cannot drift apart.
Each placeholder's ``InputRef`` (``StageProgram.inputs``) names its kind: a parameter, a buffer,
a batch tensor (or, for a Seq1F1B chunk, the columns its keys cover), this rank's coordinate,
the previous stage's activation, a K/V prefix, the chunk offset or the dropout seed.
``chunk_feeds`` cuts a micro-batch's tensors for one chunk; ``example_batch`` is the stand-in
batch of the shape-only runs. Nothing here runs a graph.
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
    keys: dict[str, torch.Tensor] | None = None,
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
    dropout seed. ``data``: the batch tensors' columns of this chunk (the whole sequence
    without chunks); ``keys``: Seq1F1B, the columns of every token the chunk's keys cover
    (the K/V prefix's and the chunk's, ``chunk_feeds``)."""
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
        elif ref.kind == "keys":
            out.append((keys or {})[ref.name])
        elif ref.kind == "kv":
            out.append(prefix[int(ref.name)])
        elif ref.kind == "offset":
            out.append(torch.tensor(offset, device=device))
        else:
            out.append(buffers[ref.name])
    return out


def chunk_feeds(
    mb: dict[str, torch.Tensor], a: int, e: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A micro-batch's feeds for the chunk of tokens ``[a, e)``: every batch tensor's columns
    ``[a, e)`` (``data``), and the optional ones' columns ``[0, e)`` (``keys``: the tokens the
    chunk's keys cover, for a Seq1F1B chunk's attention mask)."""
    data = {k: t[:, a:e] for k, t in mb.items()}
    keys = {k: t[:, :e] for k, t in mb.items() if k not in ("input_ids", "labels")}
    return data, keys


def example_batch(
    rows: int, seq: int, names: Sequence[str], device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """A stand-in batch of ``names`` for shape-only runs (the dry run, the memory probe):
    token ids 0, an all-ones attention mask, positions 0 … seq − 1."""
    ids = torch.zeros(rows, seq, dtype=torch.int64, device=device)
    out = {"input_ids": ids, "labels": ids}
    if "attention_mask" in names:
        out["attention_mask"] = torch.ones(rows, seq, dtype=torch.int64, device=device)
    if "position_ids" in names:
        pos = torch.arange(seq, dtype=torch.int64, device=device)
        out["position_ids"] = pos.expand(rows, seq).contiguous()
    return out


__all__ = ["chunk_feeds", "example_batch", "stage_inputs"]
