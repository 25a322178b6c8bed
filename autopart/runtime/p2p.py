"""Point-to-point transfers between pipeline neighbours (isend / irecv, gloo-safe).

Messages are tagged by (sending stage, micro-batch, sequence chunk, direction, index), so they
never pair up wrongly. The first micro-batch of a step sends a header per tensor (dtype,
sizes) for each chunk; every micro-batch of a step has the same shapes chunk by chunk, so later
ones send payloads only, and the receiver can post their ``irecv`` early (``Channel.prefetch``)
to overlap the transfer with compute.
Sends are asynchronous and awaited at the end of the step; receives wait with a timeout whose
error names the rank, the action and the peer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autopart.errors import AutopartError, wait

_DTYPES = [
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
]
_HEADER = 10  # dtype code, ndim, up to 8 sizes


def _tag(stage: int, mb: int, chunk: int, backward: bool, index: int, part: int) -> int:
    if mb >= 4096 or index >= 64 or chunk >= 16 or stage >= 64:
        raise AutopartError(
            "pipeline message tags allow < 64 stages, < 4096 micro-batches, < 16 "
            f"chunks and < 64 tensors per hand-over (got stage {stage}, micro-batch "
            f"{mb}, chunk {chunk}, tensor {index})",
            hint="use fewer micro-batches, chunks or stages",
        )
    return ((((stage * 4096 + mb) * 16 + chunk) * 2 + backward) * 64 + index) * 2 + part


class Channel:
    """One rank's pipeline sends and receives for one step at a time (``reset`` per step)."""

    def __init__(self, rank: int, timeout_s: float, device: torch.device | None = None) -> None:
        self.rank, self.timeout_s = rank, timeout_s
        self.device = device or torch.device("cpu")
        # headers travel on the device (NCCL sends device tensors); in the dry run (meta: no
        # data) they go over gloo on the CPU, and payloads are not sent at all
        self.dry = self.device.type == "meta"
        self.head_device = torch.device("cpu") if self.dry else self.device
        self.reset()

    def reset(self) -> None:
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.shapes: dict[tuple[bool, int, int], list[tuple[torch.dtype, list[int]]]] = {}
        self.posted: dict[tuple[bool, int, int, int], tuple[list[Any], list[torch.Tensor]]] = {}

    def send(
        self,
        tensors: list[torch.Tensor],
        peer: int,
        stage: int,
        mb: int,
        chunk: int,
        backward: bool,
    ) -> None:
        """Start sending ``tensors`` (from ``stage``) to ``peer``."""
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()
            if mb == 0:
                if t.dtype not in _DTYPES or t.dim() > _HEADER - 2:
                    raise AutopartError(
                        f"rank {self.rank}: cannot send a {t.dtype} tensor of {t.dim()} dims "
                        "between pipeline stages"
                    )
                head = torch.zeros(_HEADER, dtype=torch.int64)
                head[0], head[1] = _DTYPES.index(t.dtype), t.dim()
                head[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
                head = head.to(self.head_device)
                self.sends.append(
                    (dist.isend(head, peer, tag=_tag(stage, mb, chunk, backward, i, 0)), head)
                )
            if not self.dry:
                work = dist.isend(t, peer, tag=_tag(stage, mb, chunk, backward, i, 1))
                self.sends.append((work, t))

    def prefetch(self, peer: int, stage: int, mb: int, chunk: int, backward: bool) -> None:
        """Post the receives of a later hand-over now, if its shapes are known."""
        key = (backward, stage, mb, chunk)
        spec = self.shapes.get((backward, stage, chunk))
        if spec is None or key in self.posted or mb == 0:
            return
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in spec]
        works = [
            dist.irecv(b, peer, tag=_tag(stage, mb, chunk, backward, i, 1))
            for i, b in enumerate(bufs)
            if not self.dry
        ]
        self.posted[key] = (works, bufs)

    def recv(
        self, count: int, peer: int, stage: int, mb: int, chunk: int, backward: bool, what: str
    ) -> list[torch.Tensor]:
        """The ``count`` tensors ``stage`` sent for (``mb``, ``chunk``) (waits, with a timeout)."""
        key = (backward, stage, mb, chunk)
        if key not in self.posted:
            self.prefetch(peer, stage, mb, chunk, backward)
        if key in self.posted:
            works, bufs = self.posted.pop(key)
            for w in works:
                _wait(w, self.rank, what, peer, self.timeout_s)
            return bufs
        out, spec = [], []
        for i in range(count):
            head = torch.zeros(_HEADER, dtype=torch.int64, device=self.head_device)
            _wait(
                dist.irecv(head, peer, tag=_tag(stage, mb, chunk, backward, i, 0)),
                self.rank,
                what,
                peer,
                self.timeout_s,
            )
            head = head.cpu()
            dtype, ndim = _DTYPES[int(head[0])], int(head[1])
            shape = [int(x) for x in head[2 : 2 + ndim]]
            t = torch.empty(shape, dtype=dtype, device=self.device)
            if not self.dry:
                _wait(
                    dist.irecv(t, peer, tag=_tag(stage, mb, chunk, backward, i, 1)),
                    self.rank,
                    what,
                    peer,
                    self.timeout_s,
                )
            out.append(t)
            spec.append((dtype, shape))
        self.shapes[(backward, stage, chunk)] = spec
        return out

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            _wait(work, self.rank, "a pending send", None, self.timeout_s)
        self.sends = []


def _wait(work: Any, rank: int, what: str, peer: int | None, timeout_s: float) -> None:
    who = f" (peer rank {peer})" if peer is not None else ""
    wait(
        work,
        rank,
        f"{what}{who}",
        timeout_s,
        hint="the peer probably died or runs a different schedule",
    )
