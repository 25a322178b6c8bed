"""Host staging: c10d messages of CUDA tensors over gloo, for ranks that share a GPU.

NCCL refuses two ranks on one device (its communicators are per device), so when a node runs
more ranks than it has GPUs (``placement.shares_gpu``: one GPU, two to four ranks, say) the
process group is gloo and every CUDA tensor a rank sends, receives or reduces travels through a
host copy. The sender copies to the CPU before posting (``Tensor.cpu`` waits for the kernels
that made the value), gloo moves host memory, and the receiver copies into its device tensor when
its wait completes (``HostWork.wait``). Gloo has CUDA paths for some collectives and none for
point-to-point, so autopart stages everything the same way rather than mix the two.

``staged(tensor, group)`` decides: a CUDA tensor on a gloo group. Everything else (CPU ranks,
NCCL ranks, the dry run) goes straight to c10d. ``AUTOPART_HOST_STAGING=1`` in a rank's
environment stages CPU tensors too: the same code path (host copies, the copy back on wait),
tested on machines without a GPU (``tests/test_gpu.py``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

FORCE = "AUTOPART_HOST_STAGING"  # "1": stage CPU tensors too (module docstring)


def staged(t: torch.Tensor, group: Any = None) -> bool:
    """Whether messages of ``t`` on ``group`` go through a host copy (module docstring)."""
    if t.device.type == "meta":
        return False
    if os.environ.get(FORCE) == "1":
        return True
    return t.device.type == "cuda" and dist.get_backend(group) == "gloo"


class HostWork:
    """A c10d work on a host copy; ``wait`` copies the result into ``dest`` (None: a send,
    whose host copy this keeps alive until it has gone)."""

    def __init__(self, work: Any, host: torch.Tensor, dest: torch.Tensor | None) -> None:
        self.work, self.host, self.dest = work, host, dest
        self._copied = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        ok = self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        if ok is not False and self.dest is not None and not self._copied:
            self.dest.copy_(self.host)
            self._copied = True
        return ok is not False

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` that shares no memory with it (a CPU ``t`` is cloned)."""
    return t.detach().to("cpu", copy=True).contiguous()


def all_reduce(t: torch.Tensor, group: Any = None) -> Any:
    """Start a sum all-reduce of ``t`` in place over ``group``; returns the work to wait on."""
    if not staged(t, group):
        return dist.all_reduce(t, group=group, async_op=True)
    host = _host(t)
    return HostWork(dist.all_reduce(host, group=group, async_op=True), host, t)


def isend(t: torch.Tensor, peer: int, tag: int) -> Any:
    """Start sending ``t`` to global rank ``peer``; returns the work to wait on."""
    if not staged(t):
        return dist.isend(t, peer, tag=tag)
    host = _host(t)
    return HostWork(dist.isend(host, peer, tag=tag), host, None)


def irecv(t: torch.Tensor, peer: int, tag: int) -> Any:
    """Start receiving into ``t`` from global rank ``peer``; ``t`` holds the data once the
    returned work's ``wait`` has returned."""
    if not staged(t):
        return dist.irecv(t, peer, tag=tag)
    host = torch.empty(t.shape, dtype=t.dtype)
    return HostWork(dist.irecv(host, peer, tag=tag), host, t)
