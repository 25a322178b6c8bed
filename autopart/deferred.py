"""Deferred weight gradients: the runtime half of a split backward (zero-bubble schedules).

``autopart::weight_gemm(x, w, b, form)`` is a parameter GEMM (``form``: ``"linear"`` =
x·wᵀ + b, ``"addmm"`` = b + x·w with 2-D x, ``"matmul"`` = x·w) whose backward computes the
input gradient at once and, while a ``WeightStore`` collects for a unit, *defers* the weight and
bias gradients: it stores (x, dy) and returns no gradient for w and b. ``WeightStore.run(unit)``
later computes them (dW = dyᵀ·x or xᵀ·dy, db = Σ dy) and adds them to the parameters'
``.grad`` — the ``W`` action of the schedule. Outside a collecting unit (a plain backward, the
dry run) the backward returns all three gradients as autograd would.

The passes put the op in place of ``aten.linear``/``addmm``/``mm``/``matmul`` on a parameter
(``autopart.passes.weight_grad_split``); the forward is the same aten op, so the forward is
unchanged bit for bit, and the gradients are the same products autograd forms.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten
FORMS = ("linear", "addmm", "matmul")


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
    """The deferred weight gradients of each unit, from its ``B`` until its ``W``.

    Units of one group (``group_of``: the runner's micro-batch, over its sequence chunks) are
    computed together: a weight's deferred GEMMs of every pending unit of the group become one
    GEMM over all their tokens, in the order their ``B``s ran (the same tokens, summed in one
    product instead of one per chunk: at width 2048 on this CPU two 128-token GEMMs and their
    two additions to ``.grad`` cost 1.3× one 256-token GEMM and its one addition)."""

    def __init__(self) -> None:
        self.collecting: Hashable | None = None  # the unit whose backward is running
        self.pending: dict[Hashable, list[_Gemm]] = {}
        self._kept: dict[Hashable, dict[int, int]] = {}  # unit → id(tensor) → its bytes
        self.group_of: Callable[[Hashable], Hashable] = lambda unit: unit
        self.complete: set[Hashable] = set()  # groups whose every unit's B has run

    def defer(self, gemm: _Gemm) -> bool:
        """Keep ``gemm`` for the collecting unit's W (it holds its input and output gradient
        until then); False when no unit collects."""
        if self.collecting is None:
            return False
        self.pending.setdefault(self.collecting, []).append(gemm)
        kept = self._kept.setdefault(self.collecting, {})
        for t in (gemm.x, gemm.dy):  # a tensor several GEMMs read (Llama's q/k/v input) once
            kept[id(t)] = t.numel() * t.element_size()
        return True

    def held_bytes(self, unit: Hashable) -> int:
        """Bytes of the inputs and output gradients ``unit``'s deferred GEMMs keep until W."""
        return sum(self._kept.get(unit, {}).values())

    def run(self, unit: Hashable) -> int:
        """Compute and accumulate ``unit``'s deferred weight gradients, each merged with the same
        weight's pending GEMMs of ``unit``'s group; how many deferred GEMMs that consumed."""
        n = 0
        while self.pending.get(unit):
            n += self._run_weight(unit, self.pending[unit][0])
        self._forget(unit)
        return n

    def run_one(self) -> tuple[Hashable, int] | None:
        """Compute one weight's deferred gradient of the oldest unit whose group is complete
        (never the collecting unit's), merged over the group as ``run`` merges it; that unit
        and how many deferred GEMMs it consumed, or None when nothing is ready. Oldest first,
        so each parameter's gradient adds up in the order the schedule's ``W`` actions add it,
        bit for bit."""
        for unit, gemms in self.pending.items():
            if gemms and unit != self.collecting and self.group_of(unit) in self.complete:
                return unit, self._run_weight(unit, gemms[0])
        return None

    def done(self, unit: Hashable) -> bool:
        """True when none of ``unit``'s deferred GEMMs is left."""
        return not self.pending.get(unit)

    def clear(self) -> None:
        self.collecting = None
        self.pending.clear()
        self._kept.clear()
        self.complete.clear()

    def _run_weight(self, unit: Hashable, first: _Gemm) -> int:
        """Every pending GEMM of ``first``'s weight (and bias and form) in ``unit``'s group, as
        one GEMM over their tokens, in the order the units' ``B``s ran; how many."""
        group = self.group_of(unit)
        same: list[_Gemm] = []
        for u in list(self.pending):
            if u == self.collecting or self.group_of(u) != group:
                continue
            keep = [g for g in self.pending[u] if not first.merges_with(g)]
            same += [g for g in self.pending[u] if first.merges_with(g)]
            self.pending[u] = keep
            if not keep and u != unit:
                self._forget(u)
        dw, db = _weight_grads(same)
        _accumulate(first.w, dw)
        if first.b is not None:
            _accumulate(first.b, db)
        return len(same)

    def _forget(self, unit: Hashable) -> None:
        self.pending.pop(unit, None)
        self._kept.pop(unit, None)


STORE = WeightStore()  # one per process: the runner of the step sets ``collecting``


@dataclass(eq=False)
class _Gemm:
    """One deferred weight-gradient GEMM: its input, its output's gradient, the weight (and
    bias) it adds to, and the form of the product."""

    x: torch.Tensor
    dy: torch.Tensor
    form: str
    w: torch.Tensor
    b: torch.Tensor | None

    def merges_with(self, other: _Gemm) -> bool:
        """The same weight, bias and form: the two add up as one GEMM over both's tokens."""
        return other.w is self.w and other.b is self.b and other.form == self.form


def _weight_grads(gemms: list[_Gemm]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dW (and db) of GEMMs of one weight, over all their tokens in one product."""
    xs = [g.x.reshape(-1, g.x.shape[-1]) for g in gemms]
    dys = [g.dy.reshape(-1, g.dy.shape[-1]) for g in gemms]
    x2 = xs[0] if len(xs) == 1 else torch.cat(xs)
    dy2 = dys[0] if len(dys) == 1 else torch.cat(dys)
    head = gemms[0]
    dw = dy2.t().mm(x2) if head.form == "linear" else x2.t().mm(dy2)
    return dw, (dy2.sum(0) if head.b is not None else None)


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
    gemm = _Gemm(x, dy, form, pw, pb)
    if STORE.defer(gemm):
        return dx, None, None, None
    dw, db = _weight_grads([gemm])
    return dx, dw, db, None


weight_gemm.register_autograd(_backward, setup_context=_setup)

__all__ = ["FORMS", "STORE", "WeightStore", "weight_gemm"]
