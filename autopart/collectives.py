"""Collectives as graph operations (``torch.library.custom_op``): they print in the graph, run
under autograd, have fake implementations for shape propagation, and serialize with .pt2.

Megatron's conjugate pair over the tensor-parallel group:

- ``autopart::tp_copy``   (f): identity forward, all-reduce (sum) backward — before a
  column-parallel matmul, whose input gradient is partial on every rank;
- ``autopart::tp_reduce`` (g): all-reduce (sum) forward, identity backward — after a
  row-parallel matmul, whose output is partial on every rank.

Sequence parallelism's pair: ``autopart::tp_gather`` (all-gather along a dim forward,
reduce-scatter backward) and ``autopart::tp_scatter_reduce`` (reduce-scatter forward,
all-gather backward). Its pair around a vocabulary that stays whole: ``autopart::tp_split``
(this rank's chunk forward, all-gather backward: every rank holds the whole value) and
``autopart::tp_join`` (all-gather forward, this rank's chunk of the gradient backward: every
rank computes the joined value's gradient alike). ``autopart::vocab_parallel_ce`` is the summed cross entropy of logits
sharded by vocabulary: only [N]-sized tensors (each slice's max, sum of exp and target logit,
in one all-gather) cross ranks.

Groups are named ("tp", ...) in the graph. The ops find what a name means, and how to move
data, in the **active runtime context** (``activate``): a ``Comm`` (``autopart/runtime/comm.py``)
that each ``Runner`` owns and activates whenever it runs. This module imports nothing from the
runtime; the one process-wide value it keeps is which context is active, as torch keeps a
default process group. Every wait has a timeout; its error names the rank, the op and the
action the runtime was running (``Comm.set_action``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from autopart.errors import AutopartError

if TYPE_CHECKING:
    from autopart.runtime.comm import Comm

_ACTIVE: list[Any] = [None]  # the runtime context the ops use (``activate``)


def activate(comm: Comm | None) -> None:
    """Make ``comm`` the runtime context the graph's collectives and deferred GEMMs use in this
    process (a ``Runner`` activates its own whenever it runs; None: none)."""
    _ACTIVE[0] = comm


def current() -> Comm | None:
    """The active runtime context, or None when no runner has activated one."""
    return _ACTIVE[0]


def active() -> Comm:
    """The active runtime context."""
    comm = _ACTIVE[0]
    if comm is None:
        raise AutopartError(
            "no runtime context is active in this process: the graph's collectives have no "
            "process group",
            hint="run the program through autopart's Runner (it binds its groups), or "
            "activate an autopart.runtime.comm.Comm",
        )
    return comm


def close() -> None:
    """Unlink the active context's shared-memory files that are still linked: a rank's last
    act, also on SIGTERM (``runtime/launch.rank_setup``)."""
    if _ACTIVE[0] is not None:
        _ACTIVE[0].close()


# the three data movements, looked up at call time (tests count them by wrapping these)
def _all_reduce(x: torch.Tensor, group: str, op: Any = None) -> torch.Tensor:
    return active().all_reduce(x, group, op)


def _all_gather(x: torch.Tensor, dim: int, group: str, size: int | None = None) -> torch.Tensor:
    return active().all_gather(x, dim, group, size)


def _reduce_scatter(x: torch.Tensor, dim: int, group: str, size: int | None = None) -> torch.Tensor:
    return active().reduce_scatter(x, dim, group, size)


def _my_chunk(x: torch.Tensor, dim: int, group: str, size: int | None = None) -> torch.Tensor:
    return active().my_chunk(x, dim, group, size)


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


@torch.library.custom_op("autopart::tp_split", mutates_args=())
def tp_split(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    """This rank's chunk along ``dim`` of a value every rank of ``group`` holds whole forward
    (no message); all-gather backward. Sequence parallelism's entry after a token embedding
    that stays whole (a vocabulary tp does not divide)."""
    return _my_chunk(x, dim, group, size)


@torch.library.custom_op("autopart::tp_join", mutates_args=())
def tp_join(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    """All-gather along ``dim`` forward into a value every rank then computes with alike (an
    LM head that stays whole); backward, this rank's chunk of that gradient (every rank has the
    same one, so nothing is summed)."""
    return _all_gather(x, dim, group, size)


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
    (tp_split, _scattered),
    (tp_join, _gathered),
):
    _op.register_fake(_fake)


def _keep_group(ctx: Any, inputs: Sequence[Any], output: Any) -> None:
    ctx.args = inputs[1:]


tp_copy.register_autograd(lambda ctx, g: (tp_reduce(g, *ctx.args), None), setup_context=_keep_group)


# While a runner's step defers them (``Comm.defer_grad_reduce``), tp_all_reduce_grad's backward
# leaves this rank's partial gradient, and the runner all-reduces the step's sum of them once
# (``Comm.reduce_grads``): one message per step instead of one per parameter and unit (sums
# over the micro-batches and over the tp ranks commute).
def _grad_reduce_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
    deferred = _ACTIVE[0] is not None and _ACTIVE[0].defer_grad_reduce
    return (g if deferred else tp_reduce(g, *ctx.args), None)


tp_all_reduce_grad.register_autograd(_grad_reduce_backward, setup_context=_keep_group)
tp_reduce.register_autograd(lambda ctx, g: (g, None), setup_context=_keep_group)
tp_gather.register_autograd(
    lambda ctx, g: (tp_scatter_reduce(g, *ctx.args), None, None, None), setup_context=_keep_group
)
tp_scatter_reduce.register_autograd(
    lambda ctx, g: (tp_gather(g, *ctx.args), None, None, None), setup_context=_keep_group
)
tp_split.register_autograd(
    lambda ctx, g: (tp_gather(g, *ctx.args), None, None, None), setup_context=_keep_group
)
tp_join.register_autograd(
    lambda ctx, g: (tp_split(g, *ctx.args), None, None, None), setup_context=_keep_group
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
    if active().group(group) is not None and bool(wrong.any()):  # one rank: no check needed
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
