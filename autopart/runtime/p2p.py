"""Point-to-point transfers between pipeline neighbours (isend / irecv, gloo-safe).

Each tensor travels as a header (dtype code, ndim, sizes; int64[10]) then its payload, both
tagged by (stage, micro-batch, direction, index) so messages never pair up wrongly. Sends are
asynchronous and awaited at the end of the step; receives wait at once, with a timeout whose
error names the rank, the action and the peer.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autopart.errors import AutopartError

_DTYPES = [
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
]
_HEADER = 10


def _tag(stage: int, mb: int, backward: bool, index: int, part: int) -> int:
    return (((stage * 4096 + mb) * 2 + backward) * 64 + index) * 2 + part


def send(tensors: list[torch.Tensor], peer: int, stage: int, mb: int, backward: bool) -> list[Any]:
    """Start sending ``tensors`` to ``peer``; returns the works to wait for later."""
    works = []
    for i, t in enumerate(tensors):
        t = t.detach().contiguous()
        head = torch.zeros(_HEADER, dtype=torch.int64)
        head[0], head[1] = _DTYPES.index(t.dtype), t.dim()
        head[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        works.append((dist.isend(head, peer, tag=_tag(stage, mb, backward, i, 0)), head))
        works.append((dist.isend(t, peer, tag=_tag(stage, mb, backward, i, 1)), t))
    return works


def recv(count: int, peer: int, stage: int, mb: int, backward: bool, rank: int, what: str,
         timeout_s: float) -> list[torch.Tensor]:  # fmt: skip
    """Receive ``count`` tensors from ``peer`` (blocking, with a timeout)."""
    out = []
    for i in range(count):
        head = torch.zeros(_HEADER, dtype=torch.int64)
        _wait(
            dist.irecv(head, peer, tag=_tag(stage, mb, backward, i, 0)), rank, what, peer, timeout_s
        )
        dtype, ndim = _DTYPES[int(head[0])], int(head[1])
        t = torch.empty([int(x) for x in head[2 : 2 + ndim]], dtype=dtype)
        _wait(dist.irecv(t, peer, tag=_tag(stage, mb, backward, i, 1)), rank, what, peer, timeout_s)
        out.append(t)
    return out


def wait_all(works: list[Any], rank: int, timeout_s: float) -> None:
    for work, _ in works:
        _wait(work, rank, "a pending send", None, timeout_s)


def _wait(work: Any, rank: int, what: str, peer: int | None, timeout_s: float) -> None:
    who = f" (peer rank {peer})" if peer is not None else ""
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - any backend failure becomes a named one
        raise AutopartError(f"rank {rank}: {what}{who} failed or timed out after {timeout_s:.0f} s: {exc}",
                            hint="the peer probably died or runs a different schedule") from exc  # fmt: skip
    if ok is False:
        raise AutopartError(f"rank {rank}: timed out after {timeout_s:.0f} s in {what}{who}")
