"""A linear recurrence along one dim as one op: ``autopart::linear_scan(a, b, dim, init)``.

``h[i] = a[i] · h[i − 1] + b[i]`` along ``dim`` (elementwise in every other dim), ``h[−1]`` the
last entry of ``init`` along ``dim`` (``init`` has a length of its own there: 0 means zeros),
returns every ``h``. It is what a model's Python loop over its tokens computes (Hugging Face
Mamba's and Jamba's ``ssm_state = discrete_A[:, :, i] * ssm_state + deltaB_u[:, :, i]``), which
torch.export unrolls at the example's length; ``autopart.frontend.loops`` puts the op back in
its place, so the graph fits any length, and Seq1F1B carries ``h`` from chunk to chunk as
``init`` (``passes/sequence_chunk.py``).

The forward runs the same loop, operation for operation (the same bits as the model's own);
the backward is the recurrence reversed: with g the gradient reaching h[i] (from its users and
from h[i + 1]), ``∂a[i] = g · h[i − 1]``, ``∂b[i] = g``, and ``a[i] · g`` reaches h[i − 1]
(the last entry of ``init`` for i = 0).
"""

from __future__ import annotations

from typing import Any

import torch


@torch.library.custom_op("autopart::linear_scan", mutates_args=())
def linear_scan(
    a: torch.Tensor, b: torch.Tensor, dim: int, init: torch.Tensor | None = None
) -> torch.Tensor:
    out = torch.empty_like(b)
    h = _start(b, dim, init)
    for i in range(b.shape[dim]):
        h = a.select(dim, i) * h + b.select(dim, i)
        out.select(dim, i).copy_(h)
    return out


@linear_scan.register_fake
def _(a, b, dim, init=None):
    return torch.empty_like(b)


def _start(b: torch.Tensor, dim: int, init: torch.Tensor | None) -> torch.Tensor:
    """h[−1]: the last entry of ``init`` along ``dim``, or zeros when it has none."""
    if init is None or init.shape[dim] == 0:
        return torch.zeros_like(b.select(dim, 0))
    return init.select(dim, init.shape[dim] - 1).to(b.dtype)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    a, b, dim, init = inputs
    ctx.dim, ctx.has_init = dim, init is not None
    ctx.init_shape = None if init is None else init.shape
    ctx.save_for_backward(a, output, _start(b, dim, init))


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    a, h, h0 = ctx.saved_tensors
    dim = ctx.dim
    grad_a, grad_b = torch.empty_like(a), torch.empty_like(grad)
    carry = torch.zeros_like(h0)
    for i in reversed(range(grad.shape[dim])):
        g = grad.select(dim, i) + carry
        grad_b.select(dim, i).copy_(g)
        grad_a.select(dim, i).copy_(g * (h.select(dim, i - 1) if i else h0))
        carry = g * a.select(dim, i)
    grad_init = None
    if ctx.has_init:
        grad_init = carry.new_zeros(ctx.init_shape)
        if ctx.init_shape[dim]:
            grad_init.select(dim, ctx.init_shape[dim] - 1).copy_(carry)
    return grad_a, grad_b, None, grad_init


linear_scan.register_autograd(_backward, setup_context=_setup)
