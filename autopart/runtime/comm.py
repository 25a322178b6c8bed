"""The runtime context of a runner: what the graph's collectives and deferred GEMMs use while
it runs, in one object instead of process-wide tables.

A ``Comm`` holds the process group each graph group name means (``bind``), the action the
runtime is running and its timeout (``set_action``: named in every timeout error), how each
group moves data (``transport``), the shared-memory exchanges (``autopart.runtime.shm``), the
flag that defers the sequence-parallel gradient reduction, and the ``WeightStore`` of a split
backward (``autopart/deferred.py``). Each ``Runner`` owns one and makes it the active one
(``autopart.collectives.activate``) whenever it runs. Two runners in one process no longer share
(or overwrite) one table.

How the collectives move data (``transport``), on gloo groups:

- ``"shm"``: ranks on one x86-64 host exchange through shared memory: each writes its tensor
  once, reads the others' and sums in rank order. No socket, no helper thread. This is the
  default wherever every member can map the others' files (``AUTOPART_SHM=0`` turns it off).
- ``"exchange"``: otherwise, on groups of at most ``EXCHANGE_MAX`` ranks, every rank posts its
  sends and receives to every other at once (c10d ``isend`` / ``irecv``) and sums in rank order.
- ``"c10d"``: larger groups and other backends (NCCL) use the backend's own collectives.

The first two give every rank bitwise the same sum, the rank-order one. Measured on 2 ranks
(docs/tensor_parallel.md, ``benchmarks/collectives.py``), shared memory takes 0.24-0.54 of
gloo's all-reduce time from 4 KB to 8 MB: no socket copies, and no helper threads competing
for the cores the ranks compute on. The exchange beats gloo on small tensors only. CUDA tensors
on a gloo group (ranks sharing a GPU) go through host copies (``runtime/staging.py``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autopart.deferred import WeightStore
from autopart.errors import AutopartError, wait
from autopart.runtime import shm, staging

EXCHANGE_MAX = 4  # gloo groups up to this size exchange directly (module docstring)
_TAG = 0x7A7  # the exchange's message tag


def _close_rings(rings: dict[Any, shm.ShmGroup | None]) -> None:
    for ring in rings.values():
        if ring is not None:
            ring.close()


class Comm:
    """One runner's runtime context (module docstring)."""

    def __init__(self, groups: dict[str, Any] | None = None, timeout_s: float = 300.0) -> None:
        self.groups: dict[str, Any] = dict(groups or {})  # graph name → ProcessGroup (or None)
        self.action = "(no action)"
        self.timeout_s = timeout_s
        self.defer_grad_reduce = False  # tp_all_reduce_grad's backward leaves partial sums
        self.weights = WeightStore()  # a split backward's deferred weight gradients
        self._shm: dict[Any, shm.ShmGroup | None] = {}  # group → its exchange, if any
        self._transport: dict[Any, str] = {}  # group → transport(group), on first use
        # unlink what is still linked when this context goes, or at exit
        self._finalizer = weakref.finalize(self, _close_rings, self._shm)

    # -- what the runtime sets -------------------------------------------------------------

    def bind(self, name: str, group: Any) -> None:
        """Make the graph's group ``name`` mean ``group`` (a ProcessGroup; None: one rank)."""
        self.groups[name] = group

    def set_action(self, action: str, timeout_s: float | None = None) -> None:
        """Record what the runtime is doing (named in timeout errors)."""
        self.action = action
        if timeout_s is not None:
            self.timeout_s = timeout_s

    def group(self, name: str) -> Any:
        if name not in self.groups:
            raise AutopartError(
                f"collective group {name!r} is not bound in this process",
                hint="run the program through autopart's Runner, which binds its groups",
            )
        return self.groups[name]

    def close(self) -> None:
        """Unlink this process's shared-memory files that are still linked (end of a run)."""
        _close_rings(self._shm)

    def release(self, groups: list[Any]) -> None:
        """Forget ``groups`` (closing their shared-memory exchanges) and destroy them: the end
        of one program in a process that runs several (``autopart verify``)."""
        for g in groups:
            if g is None:
                continue
            ring = self._shm.pop(g, None)
            if ring is not None:
                ring.close()
            self._transport.pop(g, None)
            for name in [n for n, bound in self.groups.items() if bound is g]:
                del self.groups[name]
            dist.destroy_process_group(g)

    # -- how data moves ----------------------------------------------------------------------

    def _wait(self, work: Any, what: str) -> None:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        wait(work, rank, f"{what} during {self.action}", self.timeout_s)

    def shm(self, g: Any) -> shm.ShmGroup | None:
        """The shared-memory exchange of ``g``, connected on first use (None: none)."""
        if g not in self._shm:
            use = os.environ.get("AUTOPART_SHM", "1") != "0" and shm.supported()
            # every rank joins the vote, so that ranks that disagree all fall back together
            self._shm[g] = shm.ShmGroup.connect(g, use) if dist.get_backend(g) == "gloo" else None
        return self._shm[g]

    def transport(self, g: Any) -> str:
        """How collectives on ``g`` move data: "shm", "exchange", "c10d" or "local"."""
        if g is None:
            return "local"
        if g not in self._transport:
            gloo = dist.get_backend(g) == "gloo"
            self._transport[g] = (
                "shm"
                if self.shm(g) is not None
                else "exchange"
                if gloo and dist.get_world_size(g) <= EXCHANGE_MAX
                else "c10d"
            )
        return self._transport[g]

    def exchange(
        self,
        outgoing: list[torch.Tensor],
        g: Any,
        what: str,
        combine: Callable[[list[torch.Tensor]], Any],
    ) -> Any:
        """Send ``outgoing[i]`` to group rank i and receive one tensor of the same shape from
        each; returns ``combine`` of what each rank sent us, in rank order (our own entry:
        ``outgoing[me]``). ``combine`` must return fresh tensors. CUDA tensors on a gloo group
        are exchanged as host copies and combined on the host, then copied back: the same
        sums, bit for bit, as the CPU ranks'."""
        if staging.staged(outgoing[0], g) and outgoing[0].device.type != "cpu":
            host = [t.cpu() for t in outgoing]
            return self.exchange(host, g, what, combine).to(outgoing[0].device)
        ring = self.shm(g) if outgoing[0].device.type == "cpu" else None
        if ring is not None:
            return ring.exchange(outgoing, combine, f"{what} during {self.action}", self.timeout_s)
        me = dist.get_rank(g)
        got = [t if i == me else torch.empty_like(t) for i, t in enumerate(outgoing)]
        works = []
        for i, t in enumerate(outgoing):
            if i != me:
                works.append(dist.irecv(got[i], group=g, group_src=i, tag=_TAG))
                works.append(dist.isend(t, group=g, group_dst=i, tag=_TAG))
        for work in works:
            self._wait(work, what)
        return combine(got)

    def sized(self, group: str, size: int | None) -> Any:
        """The process group bound to ``group``, checked to have the ``size`` the graph was
        compiled for (the op's explicit group size; None: any)."""
        g = self.group(group)
        if g is not None and size is not None and dist.get_world_size(g) != size:
            raise AutopartError(
                f"the graph's {group} collectives were compiled for {size} ranks, but this "
                f"process bound {group} to a group of {dist.get_world_size(g)}",
                hint="run the program on the mesh it was compiled for",
            )
        return g

    # -- the collectives -----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, group: str, op: Any = None) -> torch.Tensor:
        g = self.group(group)
        what = f"all-reduce over {group} of {tuple(x.shape)}"
        if g is not None and op is None and self.transport(g) != "c10d":
            x = x.contiguous()
            return self.exchange([x] * dist.get_world_size(g), g, what, sum_in_rank_order)
        out = x.contiguous().clone()
        if g is not None and (op is None or op == dist.ReduceOp.SUM):
            self._wait(staging.all_reduce(out, g), what)
        elif g is not None:
            self._wait(dist.all_reduce(out, op=op, group=g, async_op=True), what)
        return out

    def all_gather(
        self, x: torch.Tensor, dim: int, group: str, size: int | None = None
    ) -> torch.Tensor:
        g = self.sized(group, size)
        if g is None:
            return x.clone()
        what = f"all-gather over {group} of {tuple(x.shape)}"
        x = x.contiguous()
        if self.transport(g) != "c10d":
            n = dist.get_world_size(g)
            return self.exchange([x] * n, g, what, lambda got: torch.cat(got, dim))
        host = x.cpu() if staging.staged(x, g) else x
        parts = [torch.empty_like(host) for _ in range(dist.get_world_size(g))]
        self._wait(dist.all_gather(parts, host, group=g, async_op=True), what)
        return torch.cat(parts, dim).to(x.device)

    def _even(
        self, x: torch.Tensor, dim: int, group: str, size: int | None, what: str
    ) -> tuple[Any, int, int] | None:
        """``group``'s process group, its size and this rank's index in it, once ``x`` splits
        into that many equal parts along ``dim``; None when the name means one rank."""
        g = self.sized(group, size)
        if g is None:
            return None
        n = dist.get_world_size(g)
        if x.size(dim) % n:
            raise AutopartError(
                f"{what} over {group}: dim {dim} of {tuple(x.shape)} does not split into {n} "
                "equal parts",
                hint="shard only dims divisible by the group size",
            )
        return g, n, dist.get_rank(g)

    def reduce_scatter(
        self, x: torch.Tensor, dim: int, group: str, size: int | None = None
    ) -> torch.Tensor:
        found = self._even(x, dim, group, size, "reduce-scatter")
        if found is None:
            return x.clone()
        g, n, me = found
        what = f"reduce-scatter over {group} of {tuple(x.shape)}"
        parts = [p.contiguous() for p in x.chunk(n, dim)]
        if self.transport(g) != "c10d":  # each rank gets only the slices of its own part
            return self.exchange(parts, g, what, sum_in_rank_order)
        if dist.get_backend(g) != "gloo":
            mine = torch.empty_like(parts[me])
            self._wait(dist.reduce_scatter(mine, parts, group=g, async_op=True), what)
            return mine
        out = x.contiguous().clone()  # gloo has no reduce_scatter: all-reduce, keep our slice
        self._wait(staging.all_reduce(out, g), what)
        return out.chunk(n, dim)[me].contiguous()

    def my_chunk(
        self, x: torch.Tensor, dim: int, group: str, size: int | None = None
    ) -> torch.Tensor:
        """This rank's one of ``size`` equal chunks of ``x`` along ``dim`` (no message)."""
        found = self._even(x, dim, group, size, "splitting")
        if found is None:
            return x.clone()
        _, n, me = found
        return x.chunk(n, dim)[me].clone(memory_format=torch.contiguous_format)

    def reduce_grads(self, grads: list[torch.Tensor], group: str) -> None:
        """All-reduce ``grads`` over ``group`` in place, as one flat message."""
        if not grads:
            return
        flat = self.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))


def sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """((p0 + p1) + p2) + ...: a fresh tensor, the same bits on every rank."""
    if len(parts) == 1:
        return parts[0].clone()
    out = parts[0] + parts[1]
    for t in parts[2:]:
        out += t
    return out
