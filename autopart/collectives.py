"""Collectives as graph operations (``torch.library.custom_op``): they print in the graph, run
under autograd, have fake implementations for shape propagation, and serialize with .pt2.

Megatron's conjugate pair over the tensor-parallel group:

- ``autopart::tp_copy``   (f): identity forward, all-reduce (sum) backward — before a
  column-parallel matmul, whose input gradient is partial on every rank;
- ``autopart::tp_reduce`` (g): all-reduce (sum) forward, identity backward — after a
  row-parallel matmul, whose output is partial on every rank.

Sequence parallelism's pair: ``autopart::tp_gather`` (all-gather along a dim forward,
reduce-scatter backward) and ``autopart::tp_scatter_reduce`` (reduce-scatter forward,
all-gather backward). ``autopart::vocab_parallel_ce`` is the summed cross entropy of logits
sharded by vocabulary: only [N]-sized tensors (each slice's max, sum of exp and target logit,
in one all-gather) cross ranks.

Groups are named ("tp", "dp", ...) in the graph; ``bind(name, group)`` tells this process which
ProcessGroup a name means. Every wait has a timeout; its error names the rank, the op and the
action the runtime was running (``set_action``).

How they move data (``transport``), on gloo groups:

- ``"shm"``: ranks on one x86-64 host exchange through shared memory (``autopart.runtime.shm``): each writes
  its tensor once, reads the others' and sums in rank order. No socket, no helper thread; the
  default wherever every member can map the others' files (``AUTOPART_SHM=0`` turns it off).
- ``"exchange"``: otherwise, on groups of at most ``EXCHANGE_MAX`` ranks, every rank posts its
  sends and receives to every other at once (c10d ``isend`` / ``irecv``) and sums in rank order.
- ``"c10d"``: larger groups and other backends (NCCL) use the backend's own collectives.

The first two give every rank bitwise the same sum, the rank-order one. Measured on 2 ranks
(docs/tensor_parallel.md, ``benchmarks/collectives.py``), shared memory takes 0.24-0.54 of
gloo's all-reduce time from 4 KB to 8 MB: no socket copies, and no helper threads competing
for the cores the ranks compute on. The exchange beats gloo on small tensors only.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autopart.errors import AutopartError, wait
from autopart.runtime import shm, staging

_GROUPS: dict[str, Any] = {}
_STATE: dict[str, Any] = {
    "action": "(no action)",
    "timeout_s": 300.0,
    "rank": None,
    "defer_grad_reduce": False,  # ``defer_grad_reduce``
}
_SHM: dict[Any, shm.ShmGroup | None] = {}  # group -> its shared-memory exchange, when it has one
_TRANSPORT: dict[Any, str] = {}  # group -> transport(group), decided on first use


def bind(name: str, group: Any) -> None:
    """Make the graph's group ``name`` mean ``group`` (a ProcessGroup) in this process."""
    _GROUPS[name] = group


def set_action(action: str, timeout_s: float | None = None) -> None:
    """Record what the runtime is doing (named in timeout errors)."""
    _STATE["action"] = action
    if timeout_s is not None:
        _STATE["timeout_s"] = timeout_s


def _group(name: str) -> Any:
    if name not in _GROUPS:
        raise AutopartError(
            f"collective group {name!r} is not bound in this process",
            hint="run the program through autopart's Runner, which binds its groups",
        )
    return _GROUPS[name]


def _wait(work: Any, what: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else "?"
    wait(work, rank, f"{what} during {_STATE['action']}", _STATE["timeout_s"])


EXCHANGE_MAX = 4  # gloo groups up to this size exchange directly (module docstring)
_TAG = 0x7A7  # the exchange's message tag


def _shm(g: Any) -> shm.ShmGroup | None:
    """The shared-memory exchange of ``g``, connected on first use (None: not on one host)."""
    if g not in _SHM:
        use = os.environ.get("AUTOPART_SHM", "1") != "0" and shm.supported()
        # every rank joins the vote, so that ranks that disagree all fall back together
        _SHM[g] = shm.ShmGroup.connect(g, use) if dist.get_backend(g) == "gloo" else None
    return _SHM[g]


def transport(g: Any) -> str:
    """How collectives on ``g`` move data: "shm", "exchange" or "c10d" (module docstring)."""
    if g is None:
        return "local"
    if g not in _TRANSPORT:
        gloo = dist.get_backend(g) == "gloo"
        _TRANSPORT[g] = (
            "shm"
            if _shm(g) is not None
            else "exchange"
            if gloo and dist.get_world_size(g) <= EXCHANGE_MAX
            else "c10d"
        )
    return _TRANSPORT[g]


def _exchange(
    outgoing: list[torch.Tensor], g: Any, what: str, combine: Callable[[list[torch.Tensor]], Any]
) -> Any:
    """Send ``outgoing[i]`` to group rank i and receive one tensor of the same shape from each;
    returns ``combine`` of what each rank sent us, in rank order (our own entry:
    ``outgoing[me]``). ``combine`` must return fresh tensors. CUDA tensors on a gloo group
    (ranks sharing a GPU) are exchanged as host copies and combined on the host, then copied
    back (``runtime/staging.py``): the same sums, bit for bit, as the CPU ranks'."""
    if staging.staged(outgoing[0], g) and outgoing[0].device.type != "cpu":
        return _exchange([t.cpu() for t in outgoing], g, what, combine).to(outgoing[0].device)
    ring = _shm(g) if outgoing[0].device.type == "cpu" else None
    if ring is not None:
        return ring.exchange(
            outgoing, combine, f"{what} during {_STATE['action']}", _STATE["timeout_s"]
        )
    me = dist.get_rank(g)
    got = [t if i == me else torch.empty_like(t) for i, t in enumerate(outgoing)]
    works = []
    for i, t in enumerate(outgoing):
        if i != me:
            works.append(dist.irecv(got[i], group=g, group_src=i, tag=_TAG))
            works.append(dist.isend(t, group=g, group_dst=i, tag=_TAG))
    for work in works:
        _wait(work, what)
    return combine(got)


def close() -> None:
    """Unlink this process's shared-memory files that are still linked (end of a run)."""
    for ring in _SHM.values():
        if ring is not None:
            ring.close()


def release(groups: list[Any]) -> None:
    """Forget ``groups`` (closing their shared-memory exchanges) and destroy them: the end of
    one program in a process that runs several, one after another (``autopart verify``)."""
    for g in groups:
        if g is None:
            continue
        ring = _SHM.pop(g, None)
        if ring is not None:
            ring.close()
        _TRANSPORT.pop(g, None)
        for name in [n for n, bound in _GROUPS.items() if bound is g]:
            del _GROUPS[name]
        dist.destroy_process_group(g)


atexit.register(close)


def _sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """((p0 + p1) + p2) + ...: a fresh tensor, the same bits on every rank."""
    if len(parts) == 1:
        return parts[0].clone()
    out = parts[0] + parts[1]
    for t in parts[2:]:
        out += t
    return out


def _all_reduce(x: torch.Tensor, group: str, op: Any = None) -> torch.Tensor:
    g = _group(group)
    what = f"all-reduce over {group} of {tuple(x.shape)}"
    if g is not None and op is None and transport(g) != "c10d":
        x = x.contiguous()
        return _exchange([x] * dist.get_world_size(g), g, what, _sum_in_rank_order)
    out = x.contiguous().clone()
    if g is not None and (op is None or op == dist.ReduceOp.SUM):
        _wait(staging.all_reduce(out, g), what)
    elif g is not None:
        _wait(dist.all_reduce(out, op=op, group=g, async_op=True), what)
    return out


def _sized(group: str, size: int | None) -> Any:
    """The process group bound to ``group``, checked to have the ``size`` the graph was
    compiled for (the op's explicit group size; None: any)."""
    g = _group(group)
    if g is not None and size is not None and dist.get_world_size(g) != size:
        raise AutopartError(
            f"the graph's {group} collectives were compiled for {size} ranks, but this "
            f"process bound {group} to a group of {dist.get_world_size(g)}",
            hint="run the program on the mesh it was compiled for",
        )
    return g


def _all_gather(x: torch.Tensor, dim: int, group: str, size: int | None = None) -> torch.Tensor:
    g = _sized(group, size)
    if g is None:
        return x.clone()
    what = f"all-gather over {group} of {tuple(x.shape)}"
    x = x.contiguous()
    if transport(g) != "c10d":
        return _exchange([x] * dist.get_world_size(g), g, what, lambda got: torch.cat(got, dim))
    host = x.cpu() if staging.staged(x, g) else x
    parts = [torch.empty_like(host) for _ in range(dist.get_world_size(g))]
    _wait(dist.all_gather(parts, host, group=g, async_op=True), what)
    return torch.cat(parts, dim).to(x.device)


def _reduce_scatter(x: torch.Tensor, dim: int, group: str, size: int | None = None) -> torch.Tensor:
    g = _sized(group, size)
    if g is None:
        return x.clone()
    n, me = dist.get_world_size(g), dist.get_rank(g)
    what = f"reduce-scatter over {group} of {tuple(x.shape)}"
    if x.size(dim) % n:
        raise AutopartError(
            f"reduce-scatter over {group}: dim {dim} of {tuple(x.shape)} does not split "
            f"into {n} equal parts",
            hint="shard only dims divisible by the group size",
        )
    parts = [p.contiguous() for p in x.chunk(n, dim)]
    if transport(g) != "c10d":  # each rank gets only the slices of its own part
        return _exchange(parts, g, what, _sum_in_rank_order)
    if dist.get_backend(g) != "gloo":
        mine = torch.empty_like(parts[me])
        _wait(dist.reduce_scatter(mine, parts, group=g, async_op=True), what)
        return mine
    out = x.contiguous().clone()  # gloo has no reduce_scatter: all-reduce, keep our slice
    _wait(staging.all_reduce(out, g), what)
    return out.chunk(n, dim)[me].contiguous()


# -- f and g ---------------------------------------------------------------------------------


@torch.library.custom_op("autopart::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """f: identity forward; the backward all-reduces the gradient over ``group``."""
    return x.clone()


@torch.library.custom_op("autopart::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """g: all-reduce (sum) over ``group`` forward; identity backward."""
    return _all_reduce(x, group)


@torch.library.custom_op("autopart::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    """All-gather along ``dim`` over ``group`` of ``size`` ranks forward; reduce-scatter
    backward (sequence parallelism). The size is part of the op, so shapes propagate at
    compile time without a process group."""
    return _all_gather(x, dim, group, size)


@torch.library.custom_op("autopart::tp_scatter_reduce", mutates_args=())
def tp_scatter_reduce(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    """Reduce-scatter along ``dim`` over ``group`` of ``size`` ranks forward; all-gather
    backward (sequence parallelism)."""
    return _reduce_scatter(x, dim, group, size)


@torch.library.custom_op("autopart::tp_all_reduce_grad", mutates_args=())
def tp_all_reduce_grad(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (same as f; kept for SP norms)."""
    return x.clone()


def _same(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty_like(x)


def _gathered(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] * size
    return x.new_empty(shape)


def _scattered(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] // size
    return x.new_empty(shape)


for _op, _fake in (
    (tp_copy, _same),
    (tp_reduce, _same),
    (tp_all_reduce_grad, _same),
    (tp_gather, _gathered),
    (tp_scatter_reduce, _scattered),
):
    _op.register_fake(_fake)


def _keep_group(ctx: Any, inputs: Sequence[Any], output: Any) -> None:
    ctx.args = inputs[1:]


tp_copy.register_autograd(lambda ctx, g: (tp_reduce(g, *ctx.args), None), setup_context=_keep_group)


# While a runner's step defers them (``defer_grad_reduce``), tp_all_reduce_grad's backward
# leaves this rank's partial gradient, and the runner all-reduces the step's sum of them once
# (``reduce_grads``): one message per step instead of one per parameter and unit (sums over
# the micro-batches and over the tp ranks commute).
def defer_grad_reduce(on: bool) -> None:
    """Make tp_all_reduce_grad's backward the identity (True) or an all-reduce (False)."""
    _STATE["defer_grad_reduce"] = on


def _grad_reduce_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
    return (g if _STATE["defer_grad_reduce"] else tp_reduce(g, *ctx.args), None)


def reduce_grads(grads: list[torch.Tensor], group: str) -> None:
    """All-reduce ``grads`` over ``group`` in place, as one flat message."""
    if not grads:
        return
    flat = _all_reduce(torch.cat([g.reshape(-1) for g in grads]), group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


tp_all_reduce_grad.register_autograd(_grad_reduce_backward, setup_context=_keep_group)
tp_reduce.register_autograd(lambda ctx, g: (g, None), setup_context=_keep_group)
tp_gather.register_autograd(
    lambda ctx, g: (tp_scatter_reduce(g, *ctx.args), None, None, None), setup_context=_keep_group
)
tp_scatter_reduce.register_autograd(
    lambda ctx, g: (tp_gather(g, *ctx.args), None, None, None), setup_context=_keep_group
)


# -- vocabulary-parallel cross entropy -------------------------------------------------------


@torch.library.custom_op("autopart::vocab_parallel_ce", mutates_args=())
def vocab_parallel_ce(
    logits: torch.Tensor, labels: torch.Tensor, tp_rank: torch.Tensor, group: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed CE over labels != -100 of logits [N, V/tp] sharded by vocabulary.

    Returns (loss_sum, row max [N], row sum of exp [N]); the last two are for the backward.
    """
    n_local = logits.shape[-1]
    local = labels - tp_rank * n_local  # a tensor: no host sync
    mine = (local >= 0) & (local < n_local)
    my_max = logits.detach().max(-1).values  # [N]
    # a slice of only -inf (a masked block) has no finite max to shift by: it adds exp = 0
    shift = torch.where(my_max.isfinite(), my_max, torch.zeros_like(my_max))
    my_sum = (logits - shift[:, None]).exp().sum(-1)  # [N], relative to this slice's max
    picked = logits.gather(1, local.clamp(0, n_local - 1)[:, None]).squeeze(1)
    my_target = torch.where(mine, picked, torch.zeros_like(picked))  # -inf * 0 would be NaN
    # one collective for the three [N] statistics (latency, not bytes, is what a
    # collective costs at this size): every rank combines all slices' the same way
    every = _all_gather(torch.stack([my_max, my_sum, my_target])[None], 0, group)  # [tp, 3, N]
    vocab, valid = n_local * every.shape[0], labels != -100
    wrong = valid & ((labels < 0) | (labels >= vocab))  # every tp rank holds the same labels
    if _group(group) is not None and bool(wrong.any()):  # (unbound: one-process shape tests)
        raise AutopartError(
            f"label {int(labels[wrong][0])} is outside the vocabulary [0, {vocab})",
            hint="labels are token ids, or -100 at positions the loss ignores",
        )
    row_max = every[:, 0].max(0).values
    sum_exp = (every[:, 1] * (every[:, 0] - row_max).exp()).sum(0)
    target = every[:, 2].sum(0) - row_max  # the target's shifted logit, from its owner
    loss = ((sum_exp.log() - target) * valid).sum()
    return loss, row_max, sum_exp


@vocab_parallel_ce.register_fake
def _(logits, labels, tp_rank, group):
    n = logits.shape[0]
    return logits.new_empty(()), logits.new_empty((n,)), logits.new_empty((n,))


def _ce_setup(ctx: Any, inputs: Sequence[Any], output: Any) -> None:
    logits, labels, tp_rank, _ = inputs
    ctx.save_for_backward(logits, labels, tp_rank, output[1], output[2])


def _ce_backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
    logits, labels, tp_rank, row_max, sum_exp = ctx.saved_tensors
    n_local = logits.shape[-1]
    probs = (logits - row_max[:, None]).exp() / sum_exp[:, None]  # softmax, our vocab slice
    local = labels - tp_rank * n_local  # a tensor: no host sync
    mine = (local >= 0) & (local < n_local)
    onehot = torch.zeros_like(probs).scatter_(
        1, local.clamp(0, n_local - 1)[:, None], mine[:, None].to(probs.dtype)
    )
    valid = (labels != -100).to(probs.dtype)[:, None]
    return (probs - onehot) * valid * grad, None, None, None


vocab_parallel_ce.register_autograd(_ce_backward, setup_context=_ce_setup)


# -- dropout with explicit, reproducible randomness ------------------------------------------


def _dropout_mask(
    shape: list[int],
    p: float,
    seed: torch.Tensor,
    slot: int,
    rank: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Keep-mask (scaled by 1/(1-p)) from (seed, slot[, rank]): the same inputs give the same mask.
    Drawn on the CPU, so every device draws the same mask (the dry run on meta: shape only)."""
    if seed.device.type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    mix = (
        int(seed) * 1_000_003 + slot * 7_919 + (0 if rank is None else (int(rank) + 1) * 104_729)
    ) % 2**62
    gen = torch.Generator().manual_seed(mix)
    keep = torch.rand(shape, generator=gen) >= p
    return keep.to(dtype) / (1.0 - p)


@torch.library.custom_op("autopart::dropout", mutates_args=())
def dropout(
    x: torch.Tensor, p: float, seed: torch.Tensor, slot: int, rank: torch.Tensor | None
) -> torch.Tensor:
    """Dropout whose mask is a function of (seed, slot, rank): ``rank`` given (the tp rank) for
    values split over tp — independent masks — and None for replicated values — the same mask
    on every tp rank. ``seed`` changes per step, micro-batch and data-parallel rank."""
    return x * _dropout_mask(list(x.shape), p, seed, slot, rank, x.dtype).to(x.device)


@dropout.register_fake
def _(x, p, seed, slot, rank):
    return torch.empty_like(x)


def _dropout_setup(ctx: Any, inputs: Sequence[Any], output: Any) -> None:
    ctx.args = inputs[1:]


def _dropout_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    p, seed, slot, rank = ctx.args  # the mask is recomputed, not stored
    return (
        grad * _dropout_mask(list(grad.shape), p, seed, slot, rank, grad.dtype).to(grad.device),
        None,
        None,
        None,
        None,
    )


dropout.register_autograd(_dropout_backward, setup_context=_dropout_setup)
