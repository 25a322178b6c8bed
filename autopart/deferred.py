"""Deferred weight gradients: the runtime half of a split backward (zero-bubble schedules).

``autopart::weight_gemm(x, w, b, form)`` is a parameter GEMM (``form``: ``"linear"`` =
x·wᵀ + b, ``"addmm"`` = b + x·w with 2-D x, ``"matmul"`` = x·w) whose backward computes the
input gradient at once and, while a ``WeightStore`` collects for a unit, *defers* the weight and
bias gradients: it stores (x, dy) and returns no gradient for w and b. ``WeightStore.run(unit)``
later computes them (dW = dyᵀ·x or xᵀ·dy, db = Σ dy) and adds them to the parameters'
``.grad`` — the ``W`` action of the schedule. The store is the active runtime context's
(``autopart/runtime/comm.py``, ``Comm.weights``): each runner owns one. Outside a collecting unit (a plain backward, the
dry run) the backward returns all three gradients as autograd would.

The passes put the op in place of ``aten.linear``/``addmm``/``mm``/``matmul`` on a parameter
(``autopart.passes.weight_grad_split``); the forward is the same aten op, so the forward is
unchanged bit for bit, and the gradients are the same products autograd forms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autopart.collectives import current

aten = torch.ops.aten
FORMS = ("linear", "addmm", "matmul")
Unit = tuple[int, int, int]  # (stage, micro-batch, chunk): what an F, B or W action runs


@torch.library.custom_op("autopart::weight_gemm", mutates_args=())
def weight_gemm(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, form: str
) -> torch.Tensor:
    if form == "linear":
        return aten.linear.default(x, w, b)
    if form == "addmm":
        return aten.addmm.default(b, x, w) if b is not None else aten.mm.default(x, w)
    return aten.matmul.default(x, w)


@weight_gemm.register_fake
def _(x, w, b, form):
    if form == "linear":
        return x.new_empty((*x.shape[:-1], w.shape[0]))
    return x.new_empty((*x.shape[:-1], w.shape[-1]))


class WeightStore:
    """The deferred weight gradients of each unit, from its ``B`` until its ``W``."""

    def __init__(self) -> None:
        self.collecting: Unit | None = None  # the unit whose backward is running
        self.pending: dict[Unit, list[Callable[[], None]]] = {}
        self._kept: dict[Unit, dict[int, int]] = {}  # unit → id(tensor) → its bytes

    def defer(self, work: Callable[[], None], holds: tuple[torch.Tensor, ...] = ()) -> bool:
        """Keep ``work`` for the collecting unit's W (it holds the tensors ``holds`` until
        then); False when no unit collects."""
        if self.collecting is None:
            return False
        self.pending.setdefault(self.collecting, []).append(work)
        kept = self._kept.setdefault(self.collecting, {})
        for t in holds:  # a tensor several GEMMs read (Llama's q/k/v input) counts once
            kept[id(t)] = t.numel() * t.element_size()
        return True

    def held_bytes(self, unit: Unit) -> int:
        """Bytes of the inputs and output gradients ``unit``'s deferred GEMMs keep until W."""
        return sum(self._kept.get(unit, {}).values())

    def run(self, unit: Unit) -> int:
        """Compute and accumulate ``unit``'s deferred weight gradients; how many GEMMs ran."""
        works = self.pending.pop(unit, [])
        self._kept.pop(unit, None)
        for work in works:
            work()
        return len(works)

    def run_one(self) -> Unit | None:
        """Run the oldest deferred GEMM of the unit whose ``B`` ran first (never the collecting
        unit's); that unit, or None when nothing waits. Oldest first, so each parameter's
        gradient adds up in the order the schedule's ``W`` actions would add it."""
        for unit, works in self.pending.items():
            if unit != self.collecting and works:
                works.pop(0)()
                return unit
        return None

    def done(self, unit: Unit) -> bool:
        """True when none of ``unit``'s deferred GEMMs is left."""
        return not self.pending.get(unit)

    def clear(self) -> None:
        self.collecting = None
        self.pending.clear()
        self._kept.clear()


def _store() -> WeightStore | None:
    """The active runtime context's store (``autopart.collectives.activate``), if any: the
    runner whose step is running sets its ``collecting`` unit."""
    comm = current()
    return None if comm is None else comm.weights


def _weight_grads(
    x: torch.Tensor, dy: torch.Tensor, form: str, has_b: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dw = dy2.t().mm(x2) if form == "linear" else x2.t().mm(dy2)
    return dw, (dy2.sum(0) if has_b else None)


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """Add ``g`` to parameter ``p``'s gradient, in place as autograd's ``AccumulateGrad`` does
    (an out-of-place sum allocated a new gradient per GEMM and unit: at width 1536 on CPU, B + W
    took 24 % longer than 1F1B's backward, docs/zero_bubble.md); ``p``
    computed from a parameter (the bf16 cast of a float32 master under ``precision="bf16"``)
    sends it back through that computation."""
    if p.is_leaf:
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
    else:
        torch.autograd.backward(p, g)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, w, b, form = inputs
    ctx.save_for_backward(x, w)
    ctx.form, ctx.params = form, (w, b)


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, w = ctx.saved_tensors
    form, (pw, pb) = ctx.form, ctx.params
    dx = dy.matmul(w) if form == "linear" else dy.matmul(w.t())
    if not (pw.requires_grad or (pb is not None and pb.requires_grad)):
        return dx, None, None, None

    def work() -> None:
        dw, db = _weight_grads(x, dy, form, pb is not None)
        _accumulate(pw, dw)
        if db is not None:  # the bias's, when it has one
            _accumulate(pb, db)

    store = _store()
    if store is not None and store.defer(work, (x, dy)):
        return dx, None, None, None
    dw, db = _weight_grads(x, dy, form, pb is not None)
    return dx, dw, db, None


weight_gemm.register_autograd(_backward, setup_context=_setup)

__all__ = ["FORMS", "WeightStore", "weight_gemm"]
