"""A training loop's habits that are right on one device (or under DDP) and wrong around a
``Runner``: each is refused where it happens, before anything trains on it.

- **torch's norm clipping over shards.** ``torch.nn.utils.clip_grad_norm_(runner.parameters(),
  m)`` under tp or pp sees only this rank's slices or stage, so each rank clips by its own norm
  (a different factor on every rank). ``runner.parameters()`` is a ``Parameters`` iterator that
  refuses to be read by ``torch.nn.utils.clip_grad`` there, naming ``runner.clip_grad_norm_``
  (under dp alone every rank holds every whole gradient, and torch's clipping is exact).
- **An optimizer over the model's own parameters.** The runner trains its own copies; the
  module's parameters never get a gradient, so ``AdamW(model.parameters())`` steps on nothing.
  ``guard_optimizers`` registers torch's optimizer step pre-hook, which refuses such a step.
- **A step under ``torch.autocast`` or without gradients** (``check_step_context``): the graphs
  were captured in the model's dtype (``precision="bf16"`` is autopart's mixed precision), and
  ``step`` runs the backward.
- **``loss.backward()`` on the loss ``step`` returns.** ``step`` ran the backward already; the
  loss is a ``StepLoss`` (a detached tensor, and what arithmetic on it gives) whose
  ``backward`` refuses, naming that. It raised torch's "Trying to backward through the graph a
  second time", whose hint (``retain_graph=True``) does not apply.

The third kind of habit, switching the module with ``model.train()`` / ``model.eval()``, is
followed rather than refused: the live runner takes the model's mode at every call
(``Runner.step``), as a DDP-wrapped module does.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopart.errors import AutopartError

# torch's module whose norm clipping reads the parameters it is given (clip_grad_value_ is
# elementwise: exact on shards)
_CLIP_MODULE = "torch.nn.utils.clip_grad"
_CLIP_EXACT_ON_SHARDS = frozenset({"clip_grad_value_"})


class Parameters(Iterator[nn.Parameter]):
    """``runner.parameters()``: this rank's parameters, one pass, as ``nn.Module.parameters``.
    ``sharded`` (why this rank's gradients are not the whole model's, or None) makes it refuse
    to be read by torch's norm clipping."""

    def __init__(self, params: list[nn.Parameter], sharded: str | None) -> None:
        self._it = iter(params)
        self._sharded = sharded

    def __iter__(self) -> Parameters:
        if self._sharded is not None and _is_norm_clip(sys._getframe(1)):
            raise AutopartError(
                f"torch.nn.utils.clip_grad_norm_ over runner.parameters(): {self._sharded}, so "
                "torch would take this rank's norm for the model's and every rank would clip "
                "by a different factor",
                hint="norm = runner.clip_grad_norm_(max_norm): the global norm, the same on "
                "every rank (runner.grad_norm() without clipping)",
            )
        return self

    def __next__(self) -> nn.Parameter:
        return next(self._it)


def _is_norm_clip(frame: FrameType) -> bool:
    """Is ``frame`` one of torch's gradient-norm functions (reading what it was given)?"""
    return (
        frame.f_globals.get("__name__") == _CLIP_MODULE
        and frame.f_code.co_name not in _CLIP_EXACT_ON_SHARDS
    )


def sharded_reason(tp: int, pp: int) -> str | None:
    """Why a rank of a ``tp`` × ``pp`` mesh holds only part of the gradients (None: all)."""
    parts = [
        f"its 1/{tp} slices (tp={tp})" if tp > 1 else "",
        f"its stage (pp={pp})" if pp > 1 else "",
    ]
    held = " and ".join(p for p in parts if p)
    return f"each rank holds only {held} of the model's gradients" if held else None


def guard_optimizers(runner: Any, model: nn.Module) -> None:
    """Refuse ``optimizer.step()`` on the module's own parameters once ``runner`` has stepped
    and none of them has a gradient (an optimizer built from ``model.parameters()`` rather than
    ``runner.parameters()``). A reference loop that trains the module itself gives it gradients
    and is left alone. The hook goes when the runner does."""
    ours = {id(p) for p in runner.parameters()}
    theirs = {
        id(p): (name, weakref.ref(p))
        for name, p in model.named_parameters()
        if p.requires_grad and id(p) not in ours
    }
    if not theirs:
        return
    owner = weakref.ref(runner)

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = owner()
        if live is None or live.steps == 0:
            return
        held: list[tuple[str, torch.Tensor]] = []
        for group in opt.param_groups:
            for p in group["params"]:
                name, ref = theirs.get(id(p), ("", None))
                own = ref() if ref is not None else None
                if own is not None and own is p:  # the same object (not a reused id)
                    held.append((name, own))
        if held and all(t.grad is None for _, t in held):
            raise AutopartError(
                f"{type(opt).__name__}.step() over the model's own parameters "
                f"({len(held)}, e.g. {held[0][0]}): the runner trains its own copies of them, so "
                "these have no gradient and this step would change nothing",
                hint="build the optimizer after parallelize, from runner.parameters() (or "
                "runner.named_parameters() for parameter groups); runner.copy_to(model) puts "
                "the trained weights back into the module",
            )

    handle = register_optimizer_step_pre_hook(hook)
    weakref.finalize(runner, handle.remove)


def check_step_context(call: str, device: torch.device, *, needs_grad: bool) -> None:
    """Refuse a ``call`` (``"step"``, ``"evaluate"``, ``"logits"``) under ``torch.autocast``,
    or ``step`` with gradients off (``torch.no_grad()``, ``torch.inference_mode()``)."""
    kinds = {"cpu", device.type} - {"meta"}
    on = sorted(k for k in kinds if torch.is_autocast_enabled(k))
    if on:
        raise AutopartError(
            f"runner.{call}() under torch.autocast({on[0]!r}): the program was compiled in the "
            "model's dtype, and autocast would recast its ops behind the schedule's back",
            hint='leave autocast out, and pass precision="bf16" to parallelize (bf16 compute, '
            "float32 master weights, gradients and loss)",
        )
    if needs_grad and not torch.is_grad_enabled():
        raise AutopartError(
            f"runner.{call}() with gradients off (torch.no_grad() or torch.inference_mode()): "
            "step runs the backward too",
            hint="runner.evaluate(input_ids, labels) gives the loss without gradients",
        )


class StepLoss(torch.Tensor):
    """The loss ``Runner.step`` returns: a detached tensor whose ``backward`` (and that of the
    values computed from it, ``loss / accumulation``) says that ``step`` ran the backward
    already. Anything else (``item()``, ``float()``, logging, arithmetic) is a tensor's."""

    @staticmethod
    def of(loss: torch.Tensor) -> StepLoss:
        return torch.Tensor._make_subclass(StepLoss, loss.detach())

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return repr(self.as_subclass(torch.Tensor))  # printed as the tensor it is

    def __reduce_ex__(self, proto: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict[int, Any]) -> StepLoss:
        return StepLoss.of(self.as_subclass(torch.Tensor).clone())

    def backward(self, *args: Any, **kwargs: Any) -> None:  # noqa: ARG002 - torch's signature
        raise AutopartError(
            "runner.step(...) ran the forward and the backward already: the gradients are on "
            "runner.parameters(), and the loss it returns is for logging",
            hint="call opt.step() after runner.step(...), without loss.backward(); for gradient "
            "accumulation call runner.step once per micro-batch (num_tokens= for the exact "
            "mean), then opt.step()",
        )
