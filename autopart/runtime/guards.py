"""A training loop's habits that are right on one device (or under DDP) and wrong around a
``Runner``: each is refused where it happens, before anything trains on it.

- **torch's norm clipping over shards.** ``torch.nn.utils.clip_grad_norm_(runner.parameters(),
  m)`` under tp or pp sees only this rank's slices or stage, so each rank clips by its own norm
  (a different factor on every rank). The runner's parameters are ``ShardParameter``s there,
  whose gradient refuses to be read by torch's norm clipping (however the parameters reached
  it: the iterator, a list, an optimizer's groups), naming ``runner.clip_grad_norm_`` (under dp
  alone every rank holds every whole gradient, and torch's clipping is exact).
  ``clip_grads_with_norm_`` scales by the norm it is handed: it may read them only when that
  norm is the whole model's, one ``runner.grad_norm()`` gave since the last step (torchtitan's
  ``get_total_norm`` over a rank's gradients is that rank's norm).
- **An optimizer over the model's own parameters.** The runner trains its own copies; the
  module's parameters never get a gradient, so ``AdamW(model.parameters())`` steps on nothing.
  ``guard_optimizers`` registers torch's optimizer step pre-hook, which refuses such a step.
- **A step under ``torch.autocast`` or without gradients** (``check_step_context``): the graphs
  were captured in the model's dtype (``precision="bf16"`` is autopart's mixed precision), and
  ``step`` runs the backward.
- **``loss.backward()`` on the loss ``step`` returns.** ``step`` ran the backward already; the
  loss is a ``StepLoss`` (a detached tensor, and what arithmetic on it gives) whose
  ``backward`` refuses, naming that. It raised torch's "Trying to backward through the graph a
  second time", whose hint (``retain_graph=True``) does not apply. The logits ``logits``
  returns are ``Logits``: a loss of the loop's own computed from them refuses ``backward`` the
  same way (it was torch's "element 0 of tensors does not require grad" on every rank).

- **Reading the module's weights after the runner trained** (``model(ids)``,
  ``model.state_dict()``, ``copy.deepcopy(model)``, ``torch.save(model)``,
  ``save_pretrained``): they are the weights from before ``parallelize`` until
  ``runner.copy_to(model)``. ``follow_module`` refuses those reads once an optimizer has stepped
  over the runner's parameters (or they changed in place) since the last copy.
- **torch's norm clipping over the module's parameters**
  (``clip_grad_norm_(model.parameters(), m)``): they have no gradient, so it would clip nothing.
- **Freezing or unfreezing a parameter after ``parallelize``**: the program was compiled with
  the other flag (``check_frozen``, at every step).

Other habits are followed rather than refused, as a DDP-wrapped module does: the live runner
takes the model's ``train()`` / ``eval()`` mode at every call (``Runner.step``), and
``follow_module`` makes ``model.zero_grad()`` clear the runner's gradients and
``model.load_state_dict(sd)`` load the runner too.
"""

from __future__ import annotations

import copyreg
import sys
import types
import weakref
import zlib
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from autopart.errors import AutopartError

# torch's module whose norm clipping reads the parameters it is given (clip_grad_value_ is
# elementwise: exact on shards; _clip_grads_with_norm_ scales by the norm it is handed: exact
# when that norm is the runner's global one)
_CLIP_MODULE = "torch.nn.utils.clip_grad"
_CLIP_WITH_NORM = "_clip_grads_with_norm_"  # exact when handed the global norm: checked
_CLIP_ELEMENTWISE = "clip_grad_value_"
# the tensor's own ``grad`` attribute, which ``ShardParameter.grad`` guards
_GRAD: Any = torch._C.TensorBase.__dict__["grad"]
_AVERAGING = "torch.optim.swa_utils"  # AveragedModel.update_parameters reads model.parameters()


class ShardParameter(nn.Parameter):
    """A parameter of a rank that holds only part of the model's gradients (a tp slice, a pp
    stage): torch's norm clipping refuses to read its gradient, however the parameters reached
    it (``runner.parameters()``, a list of them, an optimizer's ``param_groups``, torchtitan's
    ``[p for m in parts for p in m.parameters()]``), before it changed any. ``mark_sharded``
    gives a runner's parameters this class; everything else reads ``grad`` as ever."""

    _autopart_sharded: str  # why this rank's gradients are not the whole model's
    _autopart_norms: list[float]  # the runner's ``global_norms`` (the same list)

    @property
    def grad(self) -> torch.Tensor | None:
        clip = _norm_clip(sys._getframe(1))
        if clip is not None and clip.f_code.co_name == _CLIP_WITH_NORM:
            _check_handed_norm(self, clip.f_locals.get("total_norm"))
        elif clip is not None:
            raise AutopartError(
                f"torch.nn.utils.clip_grad_norm_ over this rank's parameters: "
                f"{self._autopart_sharded}, so torch would take this rank's norm for the "
                "model's and every rank would clip by a different factor",
                hint="norm = runner.clip_grad_norm_(max_norm): the global norm, the same on "
                "every rank (runner.grad_norm() without clipping; "
                "torch.nn.utils.clip_grads_with_norm_(runner.parameters(), max_norm, "
                "torch.tensor(runner.grad_norm())) is exact too)",
            )
        return _GRAD.__get__(self, type(self))

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        _GRAD.__delete__(self)


def mark_sharded(
    owner: object, params: list[nn.Parameter], sharded: str | None, norms: list[float]
) -> None:
    """Give ``params`` the class ``ShardParameter`` (``sharded``: why a rank holds only part of
    the gradients; None: every whole gradient, torch's clipping is exact and nothing changes).
    ``norms`` (the runner's ``global_norms``, filled in place) lists the whole model's norms
    computed since its last step: the norms ``clip_grads_with_norm_`` may be handed. A
    parameter that is the module's own object (a pp stage's, in memory) gets its class back
    when ``owner`` goes."""
    if sharded is None:
        return
    marked = []
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = ShardParameter
            marked.append(weakref.ref(p))
        if isinstance(p, ShardParameter):
            p._autopart_sharded = sharded
            p._autopart_norms = norms
    weakref.finalize(owner, _unmark, marked)


def _unmark(marked: list[weakref.ref[nn.Parameter]]) -> None:
    for ref in marked:
        p = ref()
        if p is not None and type(p) is ShardParameter:
            p.__class__ = nn.Parameter  # type: ignore[assignment]
            p.__dict__.pop("_autopart_sharded", None)
            p.__dict__.pop("_autopart_norms", None)


def _norm_clip(frame: FrameType | None) -> FrameType | None:
    """The frame of torch's gradient-norm function reading the parameters it was given, if
    ``frame`` is it (or one of its comprehensions); None otherwise (value clipping is
    elementwise: exact on shards)."""
    while frame is not None and frame.f_code.co_name.startswith("<"):
        if frame.f_globals.get("__name__") != _CLIP_MODULE:
            return None
        frame = frame.f_back  # a comprehension's frame (Python 3.11): the function it is in
    if (
        frame is not None
        and frame.f_globals.get("__name__") == _CLIP_MODULE
        and frame.f_code.co_name != _CLIP_ELEMENTWISE
    ):
        return frame
    return None


def _check_handed_norm(p: ShardParameter, total_norm: object) -> None:
    """``clip_grads_with_norm_(params, max_norm, total_norm)`` over a rank's shards is exact
    only when ``total_norm`` is the whole model's norm: one the runner computed
    (``runner.grad_norm()``) since its last step. Anything else is refused, before any
    gradient is scaled: ``torch.nn.utils.get_total_norm`` over this rank's gradients (the
    habit of torchtitan's ``clip_grad_norm_``) is this rank's norm, a different one on every
    rank."""
    known: list[float] = p.__dict__.get("_autopart_norms", [])
    try:
        value = float(total_norm)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        value = None
    if value is not None and any(
        value == k or abs(value - k) <= 1e-6 * max(abs(k), abs(value)) for k in known
    ):
        return
    seen = "no global norm since the last step" if not known else f"the runner's: {known[-1]:.6g}"
    raise AutopartError(
        f"torch.nn.utils.clip_grads_with_norm_ over this rank's parameters with a norm of "
        f"{total_norm!r} that is not the whole model's ({seen}): {p._autopart_sharded}, so a "
        "norm taken over this rank's gradients (torch.nn.utils.get_total_norm, a sum by hand) "
        "is this rank's, and every rank would clip by a different factor (one all-reduced by "
        "hand, as torchtitan's over the pp group, counts tied and tp-replicated parameters "
        "more than once)",
        hint="hand it the global norm: torch.tensor(runner.grad_norm()) (the same on every "
        "rank; dtype= the gradients' for float64), or norm = runner.clip_grad_norm_(max_norm)",
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


# the class attributes by which a followed module's class names the class it stands in for,
# and its check that the module is not behind the runner
_FOLLOWS, _CHECK = "_autopart_follows", "_autopart_check_current"


def follow_module(runner: Any, model: nn.Module) -> None:
    """Make ``model`` (the module ``runner`` was made from) behave as a DDP-wrapped module does
    around the runner, which trains its own copies of the module's parameters:

    - ``model.zero_grad()`` clears the runner's gradients too (they used to add up over steps);
    - ``model.load_state_dict(sd)`` loads the runner too (a resume used to load only the module);
    - reading the module's weights once the runner has moved its own (``model(...)``,
      ``model.state_dict()``, ``save_pretrained``, ``copy.deepcopy``, pickling) is refused until
      ``runner.copy_to(model)``: they would be the weights from before ``parallelize``;
    - torch's gradient clipping over ``model.parameters()`` (no gradient there: it clipped
      nothing) is refused, naming ``runner.clip_grad_norm_``.

    The module's class becomes a subclass of it with the same name, module and qualified name
    (as FSDP2's ``fully_shard`` does), so ``isinstance`` checks and ``save_pretrained``'s
    architecture name are unchanged, and a copy or a pickle of it is of the original class. The
    class is put back when the runner goes. The runner's weights count as moved once an optimizer
    has stepped over any of its parameters (``guard_optimizer_state``'s step hook tells the
    runner), or one of them changed in place (``Runner.moved``)."""
    base: type[nn.Module] = type(model).__dict__.get(_FOLLOWS, type(model))
    owner = weakref.ref(runner)

    def check_current(what: str) -> None:
        live = owner()
        if live is not None and live.moved():
            raise AutopartError(
                f"{what} after the runner trained: the module still holds the weights from "
                "before parallelize (the runner trains its own copies of them)",
                hint="runner.copy_to(model), on every rank (a collective), puts the trained "
                "weights into the module first; runner.full_state_dict() gives them as a state "
                "dict, and runner.logits(ids) / runner.evaluate(ids, labels) compute with them",
            )

    def zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
        base.zero_grad(self, set_to_none)
        live = owner()
        if live is not None:
            live.zero_grad(bool(set_to_none))

    def load_state_dict(self: nn.Module, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        out = base.load_state_dict(self, state_dict, *args, **kwargs)
        live = owner()
        if live is not None:
            live.mark_module()
            whole = live.state_keys is not None and set(live.state_keys) <= set(state_dict)
            behind = live.moved()
            live.load_state_dict(state_dict, strict=False)
            if whole or not behind:  # the module and the runner hold the same weights again
                live.mark_current()
        return out

    def state_dict(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        check_current("model.state_dict()")
        return base.state_dict(self, *args, **kwargs)

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        check_current(f"calling the model ({base.__name__}.forward)")
        return base.__call__(self, *args, **kwargs)

    def reduce_ex(self: nn.Module, protocol: Any) -> Any:
        check_current("copying or pickling the model")
        reduced: Any = base.__reduce_ex__(self, protocol)
        fn, args, *rest = reduced
        if fn is copyreg.__newobj__ and args == (type(self),):  # type: ignore[attr-defined]
            # made as the original class (pickle insists that __newobj__'s class be the
            # object's own; copyreg's older reconstructor does not)
            fn, args = copyreg._reconstructor, (base, object, None)  # type: ignore[attr-defined]
        return (fn, args, *rest)

    def parameters(self: nn.Module, recurse: bool = True) -> Iterator[nn.Parameter]:
        return _module_parameters(base.parameters(self, recurse), owner)

    namespace = {
        _FOLLOWS: base,
        _CHECK: staticmethod(check_current),
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "zero_grad": zero_grad,
        "load_state_dict": load_state_dict,
        "state_dict": state_dict,
        "__call__": call,
        "__reduce_ex__": reduce_ex,
        "parameters": parameters,
    }
    followed: type[nn.Module] = types.new_class(
        base.__name__, (base,), {}, lambda ns: ns.update(namespace)
    )
    model.__class__ = followed
    weakref.finalize(runner, _unfollow, weakref.ref(model), followed, base)
    runner.mark_current()


def _unfollow(ref: weakref.ref[nn.Module], followed: type, base: type) -> None:
    """The runner went: the module is of its own class again (unless a newer runner follows it)."""
    model = ref()
    if model is not None and type(model) is followed:
        model.__class__ = base


def check_current(model: nn.Module, what: str) -> None:
    """Refuse ``what`` on a module whose runner has moved its weights since (``follow_module``);
    any other module passes."""
    check = type(model).__dict__.get(_CHECK)
    if check is not None:
        check(what)


def original_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` without ``follow_module``'s check (``Runner.copy_to``'s keys)."""
    cls: type[nn.Module] = type(model).__dict__.get(_FOLLOWS, type(model))
    return cls.state_dict(model)


def _module_parameters(
    params: Iterator[nn.Parameter], owner: weakref.ref[Any]
) -> Iterator[nn.Parameter]:
    """``model.parameters()`` of a followed module: a generator, as torch's, which refuses to be
    read by torch's gradient clipping once the runner has stepped if none of them has a
    gradient (they never get one: the runner trains its own copies), and, once the runner's
    weights moved, by ``AveragedModel.update_parameters(model)`` (it averaged the weights from
    before ``parallelize``: 0.66 off) and by an optimizer built over them. Other readers (a
    ``.device``, ``zero_grad``, Hugging Face's helpers) are left alone: a loop's own read of
    their values (a clamp, a norm) is not seen."""
    live, caller = owner(), sys._getframe(1)
    reader = caller.f_globals.get("__name__", "")
    if reader == _AVERAGING and live is not None and live.moved():
        raise AutopartError(
            "averaging model.parameters() after the runner trained (AveragedModel's "
            "update_parameters(model)): the module still holds the weights from before "
            "parallelize (the runner trains its own copies of them)",
            hint="runner.copy_to(model) (on every rank) before each update puts the trained "
            "weights into the module; or keep the average of runner.parameters() yourself",
        )
    if reader.startswith("torch.optim.") and live is not None and live.moved():
        raise AutopartError(  # an optimizer built over them now
            "an optimizer over model.parameters() after the runner trained: the runner "
            "trains its own copies of them, so these have no gradient and hold the weights "
            "from before parallelize",
            hint="build the optimizer from runner.parameters() (or runner.named_parameters() "
            "for parameter groups)",
        )
    if _is_clip(caller) and live is not None and live.steps:
        held = list(params)
        if held and all(p.grad is None for p in held):
            while caller.f_code.co_name.startswith("<") and caller.f_back is not None:
                caller = caller.f_back  # a comprehension's frame: the function it is in
            raise AutopartError(
                f"torch.nn.utils.{caller.f_code.co_name} over model.parameters(): the "
                "runner trains its own copies of the module's parameters, so these have no "
                "gradient and nothing would be clipped",
                hint="norm = runner.clip_grad_norm_(max_norm): the global norm, the same on "
                "every rank (under dp alone, torch's over runner.parameters() is exact too)",
            )
        params = iter(held)
    yield from params


def _is_clip(frame: FrameType) -> bool:
    """Is ``frame`` in torch's gradient clipping (norm or value)?"""
    return frame.f_globals.get("__name__") == _CLIP_MODULE


def check_untouched(params: list[tuple[str, nn.Parameter]], versions: list[int], call: str) -> None:
    """Refuse ``call`` (``runner.step``, ...) once one of the module's own parameters (``params``,
    those the runner does not train itself) has changed in place since the runner took them
    (``versions``): a clamp or a hand-made update of ``model.parameters()`` after
    ``parallelize`` (max-norm constraints, weight clipping) changed only the module, and the
    runner trained on without it."""
    for (name, p), seen in zip(params, versions, strict=True):
        if p._version != seen:
            raise AutopartError(
                f"runner.{call}(): the model's parameter {name} was changed in place after "
                "parallelize "
                "(a clamp_, copy_ or other in-place update of model.parameters()); the runner "
                "trains its own copies of the parameters, so the change would not reach it",
                hint="change runner.parameters() / runner.named_parameters() instead (with "
                "torch.no_grad(), as for any parameter); model.load_state_dict(sd) loads new "
                "weights into both",
            )


def module_layout(model: nn.Module) -> list[tuple[str, int, torch.dtype]]:
    """(name, object, dtype) of every parameter of ``model``, tied names included."""
    return [(n, id(p), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)]


def check_layout(model: nn.Module, layout: list[tuple[str, int, torch.dtype]], call: str) -> None:
    """Refuse ``call`` once the module's parameters are no longer those ``parallelize`` took
    (``layout``, ``module_layout`` then): a parameter replaced by a new one (an LM head untied
    by ``lm_head.weight = nn.Parameter(...)``) or cast (``model.half()``, ``model.to(dtype)``).
    The runner trained on with the old ones, tied and in the old precision, silently."""
    now = module_layout(model)
    if now == layout:
        return
    before = {name: (obj, dtype) for name, obj, dtype in layout}
    after = {name: (obj, dtype) for name, obj, dtype in now}
    name = next((n for n in [*before, *after] if before.get(n) != after.get(n)), "?")
    old, new = before.get(name), after.get(name)
    if old is None or new is None:
        how = "added" if old is None else "removed"
    elif old[1] != new[1]:
        how = f"cast from {old[1]} to {new[1]} (model.half(), model.to(dtype))"
    else:
        how = "replaced by another tensor (a new nn.Parameter, an untied weight)"
    raise AutopartError(
        f"runner.{call}(): the model's parameter {name} was {how} after parallelize; the runner "
        "was compiled from the parameters it was given and trains its own copies of them, so "
        "the change would not reach it",
        hint="make such changes before parallelize(model, mesh) (or call parallelize again "
        "after them); for precision, pass precision='bf16' to parallelize",
    )


def module_hooks(model: nn.Module) -> list[tuple[str, int, int]]:
    """(module name, forward hooks, forward pre-hooks) of every module with any."""
    return [
        (name, len(m._forward_hooks), len(m._forward_pre_hooks))
        for name, m in model.named_modules()
        if m._forward_hooks or m._forward_pre_hooks
    ]


def check_hooks(model: nn.Module, hooks: list[tuple[str, int, int]], call: str) -> None:
    """Refuse ``call`` once a forward hook was added to (or removed from) a module after
    ``parallelize``: the program was captured with the hooks there were (export traced them
    into the graph), so a later one would never run (a hook scaling a block's output was
    dropped without a word: weights 97 % off)."""
    now = module_hooks(model)
    if now == hooks:
        return
    name = next(
        (a[0] for a, b in zip([*now, ("", 0, 0)], [*hooks, ("", 0, 0)], strict=False) if a != b),
        "?",
    )
    raise AutopartError(
        f"runner.{call}(): the forward hooks of module {name or '<root>'} changed after "
        "parallelize; the program was captured with the hooks the model had then (they are in "
        "its graph), so the change would not reach it",
        hint="register forward hooks before parallelize(model, mesh), or call parallelize "
        "again after changing them",
    )


def check_grad_hooks(params: Mapping[str, torch.Tensor], plan: Any, call: str) -> None:
    """Refuse ``call`` when a parameter the runner trains carries a post-accumulate-grad hook
    (an optimizer step in backward) and the plan accumulates its gradient over several
    backward passes (micro-batches, sequence chunks) or reduces it afterwards (dp): the hook
    fired on each partial gradient (112 calls for 56 steps, weights 100 % off)."""
    several = plan.mesh.dp > 1 or plan.microbatches > 1 or plan.seq_chunks > 1
    if not several:
        return
    for name, p in params.items():
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise AutopartError(
                f"runner.{call}(): parameter {name} has a post-accumulate-grad hook (an "
                "optimizer step in backward), but this plan's gradient is accumulated over "
                f"several backward passes (dp={plan.mesh.dp}, {plan.microbatches} "
                f"micro-batches, {plan.seq_chunks} sequence chunks) and reduced after them: "
                "the hook would fire on partial gradients",
                hint="step the optimizer after runner.step() instead (the gradients are then "
                "whole and reduced)",
            )


def check_frozen(model: nn.Module, frozen: frozenset[str]) -> None:
    """Refuse a step of a runner whose module has had a parameter frozen or unfrozen since
    ``parallelize`` (``frozen``: its frozen parameters then): the program was compiled, and its
    gradient buckets built, with the other flag, so the runner would silently go on training
    it (or keep it frozen)."""
    now = {name for name, p in model.named_parameters() if not p.requires_grad}
    if now != frozen:
        changed = sorted(now ^ frozen)
        how = "frozen" if changed[0] in now else "unfrozen"
        raise AutopartError(
            f"{len(changed)} parameters of the model were frozen or unfrozen after parallelize "
            f"(e.g. {changed[0]}, now {how}): the runner was compiled with the other flag and "
            "would not follow",
            hint="set requires_grad before parallelize(model, mesh), or call parallelize "
            "again after changing it",
        )


# the entry by which a runner parameter's optimizer state names the slice it is the state of
SHARD_STATE = "autopart_shard"


# torch's optimizers whose update of each entry reads that entry's gradient and state only:
# exact on a tp rank's slices (an optimizer class may declare itself one with
# ``autopart_elementwise = True``)
ELEMENTWISE_OPTIMIZERS = frozenset(
    (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Adagrad",
        "Adadelta",
        "ASGD",
        "Rprop",
    )
)


def check_elementwise(opt: torch.optim.Optimizer, live: Any, held: set[int]) -> None:
    """Refuse a step of an optimizer not known to update entry by entry over parameters that tp
    split into slices: Muon (a matrix's orthogonalization), Adafactor (row and column
    statistics), LARS / LAMB (a tensor's norm) computed each rank's update from its slice
    alone, silently (the loop probe: weights 20 %, 0.5 % and 0.1 % off at tp=2)."""
    cls = type(inner_optimizer(opt))  # ZeRO steps its inner optimizer over each dp rank's part
    if getattr(cls, "autopart_elementwise", False) or (
        cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE_OPTIMIZERS
    ):
        return
    sliced = [
        fqn
        for fqn, p in live.params.items()
        if id(p) in held and live.program.shards[fqn].parts > 1
    ]
    if sliced:
        raise AutopartError(
            f"rank {live.rank}: {cls.__name__}.step() over {sliced[0]}, which tp split into "
            f"slices ({len(sliced)} such parameters): autopart knows torch's elementwise "
            f"optimizers ({', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}) to update a slice as "
            f"the whole parameter would be; an optimizer that reads a whole tensor (a norm, a "
            "matrix decomposition, row and column statistics: Muon, Adafactor, LARS, LAMB) "
            "would update each rank's slice from that slice alone",
            hint="use one of those optimizers under tp, or this one with dp and pp only; an "
            "optimizer class that does update entry by entry can say so with "
            "autopart_elementwise = True",
        )


def inner_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt``, or the optimizer a ``ZeroRedundancyOptimizer`` runs on its part."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


def check_zero_group(opt: torch.optim.Optimizer, live: Any) -> None:
    """Refuse a ``ZeroRedundancyOptimizer`` step over the runner's parameters whose process
    group reaches ranks that hold other parameters (another pipeline stage, another tp slice):
    only the dp replicas hold the same ones. Its step broadcasts each part from its owner, and
    across stages those parts differ: every rank hung, silently (the loop probe, dp=2 × pp=2,
    the default group)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not isinstance(opt, ZeroRedundancyOptimizer):
        return
    dp = live.groups.get("dp")
    replicas = dist.get_process_group_ranks(dp) if dp is not None else [dist.get_rank()]
    group = opt.process_group if opt.process_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    others = sorted(set(ranks) - set(replicas))
    if others:
        raise AutopartError(
            f"rank {live.rank}: ZeroRedundancyOptimizer.step() over process group ranks "
            f"{sorted(ranks)}, of which {others} hold other parameters than this rank (another "
            f"pipeline stage or tp slice; only its dp replicas {sorted(replicas)} hold the same): "
            "its step would broadcast parts that differ between them and hang",
            hint="shard over the dp replicas only: ZeroRedundancyOptimizer(runner.parameters(), "
            "optimizer_class=..., process_group=mesh['dp'].get_group())",
        )


def guard_optimizer_state(runner: Any) -> None:
    """Refuse ``optimizer.step()`` over the runner's parameters while their gradients are those
    of ``no_sync()`` steps, not yet reduced over dp (``Runner.check_reduced``), and over
    optimizer state loaded from another rank's slice of a parameter (DDP's habit: rank 0 saves ``opt.state_dict()``, every rank loads it). Under tp
    each rank's moments are those of its own slices, of the same shape as another tp rank's,
    so ``load_state_dict`` took them silently and trained the wrong moments. After each step,
    every state of this runner's parameters gets a plain ``int`` entry, ``SHARD_STATE``: a
    CRC of the parameter's name and its slice (index of parts), so the dp replicas, which hold
    the same slices, share it, and ``load_state_dict`` carries it (torch casts only tensors).
    Before each step, an entry that is not this rank's is refused. The hooks go with the
    runner."""
    owner = weakref.ref(runner)

    def code(live: Any, fqn: str) -> int:
        shard = live.program.shards[fqn]
        return zlib.crc32(f"{fqn}|{shard.index}/{shard.parts}".encode())

    def check(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = owner()
        if live is None:
            return
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        if any(id(p) in held for p in live.params.values()):
            live.check_reduced(f"{type(opt).__name__}.step()")
        check_elementwise(opt, live, held)
        if any(id(p) in held for p in live.params.values()):
            check_zero_group(opt, live)
        for fqn, p in live.params.items():
            st = opt.state.get(p)
            if st and SHARD_STATE in st and st[SHARD_STATE] != code(live, fqn):
                raise AutopartError(
                    f"rank {live.rank}: {type(opt).__name__}'s state of {fqn} was saved by a "
                    "rank holding another slice or stage of the model (under tp and pp each "
                    "rank's optimizer state is its own slices'; only dp replicas share it): "
                    "this step would train with another slice's moments",
                    hint="save opt.state_dict() on every rank and load each rank its own, or "
                    "use autopart.checkpoint.save / load (which also reshards)",
                )

    def mark(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = owner()
        if live is None:
            return
        live.optimizer_stepped(opt)  # the module the runner follows may be behind now
        for fqn, p in live.params.items():
            st = opt.state.get(p)
            if st and SHARD_STATE not in st:  # (never into an empty state: torch's first-step
                st[SHARD_STATE] = code(live, fqn)  # initialization looks for one)

    handles = [register_optimizer_step_pre_hook(check), register_optimizer_step_post_hook(mark)]
    for handle in handles:
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


class _Plain(torch.Tensor):
    """A detached tensor of a class that says something to one caller only: it prints, copies
    and saves as the plain tensor it is (a checkpoint holding one loads with
    ``weights_only=True``)."""

    WHY = HINT = ""

    @classmethod
    def of(cls, t: torch.Tensor) -> Any:
        return torch.Tensor._make_subclass(cls, t.detach())

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return repr(self.as_subclass(torch.Tensor))  # printed as the tensor it is

    def __reduce_ex__(self, proto: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return type(self).of(self.as_subclass(torch.Tensor).clone())


class _Detached(_Plain):
    """A detached tensor whose ``backward`` (and that of the values computed from it, which
    keep its class) raises ``WHY`` with ``HINT``. Anything else (``item()``, ``float()``,
    logging, arithmetic) is a tensor's."""

    def backward(self, *args: Any, **kwargs: Any) -> None:  # noqa: ARG002 - torch's signature
        raise AutopartError(self.WHY, hint=self.HINT)


class RankSlice(_Plain):
    """A tensor of ``Runner.state_dict()`` that is this rank's tp slice of a parameter, under
    the parameter's global name. ``torch.distributed.checkpoint`` (torchtitan's
    ``dcp.save({"model": ...})``) would take it for the whole tensor: every tp rank's slice has
    the same name and shape, so DCP saved one rank's and loaded it into every rank (measured: a
    query weight 158 % off after a round trip at tp=2). Its DCP hooks (the ``_Checkpointable``
    protocol DCP asks every value for) refuse, naming ``autopart.checkpoint``; anything else
    is a plain tensor's (arithmetic gives plain tensors; it prints, copies and saves as one)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    WHY = (
        "torch.distributed.checkpoint cannot save or load {what} a tensor of "
        "runner.state_dict() under tp: it holds this rank's slice under the whole parameter's "
        "name, so every tp rank's slice would be saved as the same tensor and one of them "
        "loaded into every rank"
    )
    HINT = (
        "autopart.checkpoint.save(path, runner, optimizer, step) and .load(path, runner, "
        "optimizer) save with DCP by global name, each slice once, loadable in any layout; or "
        "gather the whole model with runner.full_state_dict() on every rank"
    )

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:  # noqa: ARG002
        raise AutopartError(self.WHY.format(what=f"{fqn!r}:"), hint=self.HINT)

    def __create_chunk_list__(self) -> list[Any]:
        raise AutopartError(self.WHY.format(what="into"), hint=self.HINT)


class StepLoss(_Detached):
    """The loss ``Runner.step`` returns: ``loss.backward()`` (DDP's habit; ``loss /
    accumulation`` too) says that ``step`` ran the backward already."""

    WHY = (
        "runner.step(...) ran the forward and the backward already: the gradients are on "
        "runner.parameters(), and the loss it returns is for logging"
    )
    HINT = (
        "call opt.step() after runner.step(...), without loss.backward(); for gradient "
        "accumulation call runner.step once per micro-batch (num_tokens= for the exact "
        "mean), then opt.step(); a GradScaler has nothing to scale: "
        "parallelize(..., precision='bf16') is the mixed precision, with no loss scale"
    )


class Logits(_Detached):
    """The logits ``Runner.logits`` returns: a loss computed from them and ``backward()`` (a
    loss of the loop's own) says that they are forward only. It raised torch's "element 0 of
    tensors does not require grad" on every rank."""

    WHY = (
        "runner.logits(...) computes the forward only, with no graph to differentiate: a loss "
        "computed from its logits cannot be trained through the ranks"
    )
    HINT = (
        "train with runner.step(input_ids, labels): the model's next-token cross entropy, "
        "whose gradients it computes on every rank; runner.logits is for sampling and "
        "evaluation"
    )
