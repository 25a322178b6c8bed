"""Point-to-point transfers between pipeline neighbours (isend / irecv, gloo-safe).

Messages are tagged by (sending stage, micro-batch, sequence chunk, direction, index), packed
as wide as the plan needs (``Tags``), so they never pair up wrongly. The first micro-batch of a step sends a header per tensor (dtype,
sizes) for each chunk; every micro-batch of a step has the same shapes chunk by chunk, so later
ones send payloads only, and the receiver can post their ``irecv`` early (``Channel.prefetch``)
to overlap the transfer with compute.
Sends are asynchronous and awaited at the end of the step; receives wait with a timeout whose
error names the rank, the action and the peer.

**Work while waiting** (``Channel.filler``, zero-bubble schedules): a receive that was posted
early is watched by a helper thread blocked in ``Work.wait`` (gloo cannot be polled: its
``is_completed`` stays False until waited on, and a wait that times out closes the
connection); while that thread has not seen the data arrive, ``recv`` calls the filler (one
deferred weight-gradient GEMM) instead of blocking, until the data is there or the filler has
nothing left. ``Work.wait`` releases the GIL, so the thread costs no compute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from autopart.errors import AutopartError, wait
from autopart.runtime import staging
from autopart.schedule.tags import Tags

_DTYPES = (
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
)
_HEADER = 10  # dtype code, ndim, up to 8 sizes


class Channel:
    """One rank's pipeline sends and receives for one step at a time (``reset`` per step)."""

    def __init__(
        self, rank: int, timeout_s: float, tags: Tags, device: torch.device | None = None
    ) -> None:
        self.rank, self.timeout_s, self.tags = rank, timeout_s, tags
        self.device = device or torch.device("cpu")
        # headers travel on the device (NCCL sends device tensors; ranks sharing a GPU send
        # through host copies, runtime/staging.py); in the dry run (meta: no data) they go over
        # gloo on the CPU, and payloads are not sent at all
        self.dry = self.device.type == "meta"
        self.head_device = torch.device("cpu") if self.dry else self.device
        # work to do while a posted receive has not arrived: returns False when it has none
        self.filler: Callable[[], bool] | None = None
        self.reset()

    def reset(self) -> None:
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.shapes: dict[tuple[bool, int, int], list[tuple[torch.dtype, list[int]]]] = {}
        # (works, buffers, the watch of a receive the filler may work beside, or None)
        self.posted: dict[tuple[bool, int, int, int], tuple[list[Any], list[Any], Any]] = {}

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
                    (
                        staging.isend(head, peer, self.tags.tag(stage, mb, chunk, backward, i, 0)),
                        head,
                    )
                )
            if not self.dry:
                work = staging.isend(t, peer, self.tags.tag(stage, mb, chunk, backward, i, 1))
                self.sends.append((work, t))

    def prefetch(self, peer: int, stage: int, mb: int, chunk: int, backward: bool) -> None:
        """Post the receives of a later hand-over now, if its shapes are known."""
        key = (backward, stage, mb, chunk)
        spec = self.shapes.get((backward, stage, chunk))
        if spec is None or key in self.posted or mb == 0:
            return
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in spec]
        works = [
            staging.irecv(b, peer, self.tags.tag(stage, mb, chunk, backward, i, 1))
            for i, b in enumerate(bufs)
            if not self.dry
        ]
        watched = self.filler is not None and bool(works) and self.device.type == "cpu"
        self.posted[key] = (works, bufs, _Watch(works, 2 * self.timeout_s) if watched else None)

    def recv(
        self, count: int, peer: int, stage: int, mb: int, chunk: int, backward: bool, what: str
    ) -> list[torch.Tensor]:
        """The ``count`` tensors ``stage`` sent for (``mb``, ``chunk``) (waits, with a timeout)."""
        key = (backward, stage, mb, chunk)
        if key not in self.posted:
            self.prefetch(peer, stage, mb, chunk, backward)
        if key in self.posted:
            works, bufs, watch = self.posted.pop(key)
            if watch is None:
                for w in works:
                    _wait(w, self.rank, what, peer, self.timeout_s)
                return bufs
            while not watch.done.is_set() and self.filler is not None and self.filler():
                pass  # work while waiting, then wait out what is left
            watch.result(self.rank, f"{what} (peer rank {peer})", self.timeout_s)
            return bufs
        out, spec = [], []
        for i in range(count):
            head = torch.zeros(_HEADER, dtype=torch.int64, device=self.head_device)
            _wait(
                staging.irecv(head, peer, self.tags.tag(stage, mb, chunk, backward, i, 0)),
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
                    staging.irecv(t, peer, self.tags.tag(stage, mb, chunk, backward, i, 1)),
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


class _Watch:
    """A helper thread that waits for a posted receive's works; ``done`` is set when they
    completed or failed."""

    def __init__(self, works: list[Any], timeout_s: float) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._works, self._timeout = works, timeout_s
        threading.Thread(target=self._run, daemon=True, name="autopart-recv").start()

    def _run(self) -> None:
        try:
            for w in self._works:
                if w.wait(timeout=timedelta(seconds=self._timeout)) is False:
                    raise TimeoutError(f"no data after {self._timeout:.0f} s")
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting rank
            self.error = exc
        finally:
            self.done.set()

    def result(self, rank: int, what: str, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` more; a failure or timeout names the rank and action."""
        if not self.done.wait(timeout_s):
            self.error = TimeoutError("no data")
        if self.error is not None:
            raise AutopartError(
                f"rank {rank}: {what} failed or timed out after {timeout_s:.0f} s: {self.error}",
                hint="the peer failed (its own error is in its output), died, or runs a different schedule",
            ) from self.error


def _wait(work: Any, rank: int, what: str, peer: int | None, timeout_s: float) -> None:
    who = f" (peer rank {peer})" if peer is not None else ""
    wait(
        work,
        rank,
        f"{what}{who}",
        timeout_s,
        hint="the peer failed (its own error is in its output), died, or runs a different schedule",
    )
