"""Capture: an unmodified model + example batch → one functional, annotated FX graph.

``capture(model, (input_ids, labels))`` exports ``loss_sum = CE(model(input_ids), labels)``
with ``torch.export`` (non-strict) and symbolic batch and sequence dims. The result is a
``Captured``: a ``GraphModule`` whose placeholders are the parameters (by global FQN), buffers,
``input_ids`` and ``labels``, and whose single output is the **summed** next-token cross
entropy over non-ignored (-100) labels. The runtime divides by the global token count.

Every node carries, besides torch.export's ``meta["val"]`` (a FakeTensor with SymInt shapes):

- ``meta["autopart.module"]``: the module path inside the user's model ("" for the root);
- ``meta["autopart.layer"]``: the transformer block index, or ``None`` outside blocks;
- ``meta["autopart.input"]`` (placeholders only): an ``InputRef`` naming what feeds it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import linecache
import os
import re
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import sympy
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind

from autopart.errors import AutopartError, first_line
from autopart.frontend.loops import fixed_length, reroll
from autopart.frontend.shapes import holds_at
from autopart.graph import copy_graph, remove_dead
from autopart.meta import (
    META_BUFFERS,
    META_EXAMPLE_SHAPE,
    META_INPUT,
    META_LAYER,
    META_LOOPS,
    META_MODULE,
    META_PROOFS,
    META_RANGES,
    META_SYMBOLS,
    InputRefKind,
)

B, S = (
    sympy.Symbol("b", positive=True, integer=True),
    sympy.Symbol("s", positive=True, integer=True),
)
_PREFIX = "model."  # the wrapper's attribute name, stripped from every FQN


@dataclass(frozen=True)
class InputRef:
    """What feeds a placeholder: a parameter/buffer/constant by FQN, a batch tensor, this rank's
    index in a group ("rank", by group name), a seed the runtime sets per step ("rng"), the
    previous stage's output ("act"), a chunk's offset or K/V prefix ("offset", "kv"): see
    ``autopart.meta.InputRefKind``."""

    kind: InputRefKind
    name: str


@dataclass
class Captured:
    """The captured model: one functional graph plus the tensors that feed it."""

    graph: fx.GraphModule
    params: dict[str, torch.Tensor]  # canonical FQN → tensor (real or meta)
    buffers: dict[str, torch.Tensor]  # buffers and lifted constants, by name
    tied: dict[str, str]  # alias FQN → canonical FQN (e.g. lm_head.weight → transformer.wte.weight)
    example_shape: tuple[int, int]  # (batch, seq) of the example inputs
    dtype: torch.dtype
    vocab_size: int
    symbols: dict[str, sympy.Symbol] = field(default_factory=lambda: {"b": B, "s": S})
    # the batch tensors the graph takes (DATA_NAMES order): a step must pass exactly these
    batch_names: tuple[str, ...] = ("input_ids", "labels")
    # the longest sequence the graph fits and why not longer (frontend/shapes.py): found by
    # the first compile of this capture (None until then)
    seq_limit: tuple[int | None, str] | None = None
    # the shortest sequence it fits and why not shorter (None until the first compile)
    seq_floor: tuple[int | None, str] | None = None
    # the multiple of tokens every length must be and why (None until the first compile)
    seq_step: tuple[int, str] | None = None
    # export fixed the length (a loop over the tokens): "rolled up" when ``generalize_loops``
    # wrote the loop for any length, else why it could not; "" when the length stayed symbolic
    loops: str = ""
    # the nodes that mix rows of the batch, as (node, module, how) (passes/seq_rules.py
    # ``rows_mixed``): found by the first compile of a plan that splits the batch
    rows_mixed: list[tuple[str, str, str]] | None = None
    # masks and score functions proven by evaluation, by construction (passes/position_masks.py
    # ``Proofs``): every compile of this capture proves each once
    proofs: dict = field(default_factory=dict)

    def for_passes(self) -> fx.GraphModule:
        """A copy of the graph that passes may change, with the metadata they read: the
        example's shape and the proofs this capture has made (shared by its compiles)."""
        gm = copy_graph(self.graph)
        gm.meta[META_EXAMPLE_SHAPE], gm.meta[META_PROOFS] = self.example_shape, self.proofs
        return gm

    @property
    def n_layers(self) -> int:
        layers = {n.meta.get(META_LAYER) for n in self.graph.graph.nodes}
        return len(layers - {None})

    def placeholders(self, kind: str | None = None) -> list[fx.Node]:
        nodes = [n for n in self.graph.graph.nodes if n.op == "placeholder"]
        return [n for n in nodes if kind is None or n.meta[META_INPUT].kind == kind]


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a model output: a tensor, a tuple starting with it, ``.logits`` or a
    mapping's ``"logits"``."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise AutopartError(
        f"the model returned {type(out).__name__}, which holds no logits",
        hint="return the logits, a tuple whose first element is the logits, "
        "an object with a `logits` field or a dict with a 'logits' entry",
    )


def model_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    extra: Mapping[str, Any] | None = None,
    *,
    params: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The logits ``(b, s, V)`` of ``model`` on a batch (``extra``: its optional tensors by
    name), called as autopart calls it everywhere (capture, ``verify``'s reference):
    ``_called``'s logits."""
    return _called(model, input_ids, labels, params, dict(extra or {}))[0]


def _called(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    params: dict[str, torch.Tensor] | None,
    extra: dict[str, Any],
) -> tuple[torch.Tensor, bool]:
    """``model``'s logits and whether it was called twice. Called with the optional batch
    tensors by name and no K/V cache (Hugging Face models keep one by default, whose outputs
    would keep every attention's K and V whole). A model that returns logits of fewer positions
    than the tokens and whose ``forward`` takes ``targets`` or ``labels`` (nanoGPT's
    ``forward(idx, targets=None)`` computes the last position's only, for generation) is
    called again with the labels there, ignored ones (-100) as 0 (nanoGPT's loss ignores -1).
    Its own loss is not used: autopart's is the cross entropy of the logits (capture drops the
    first call and the model's loss from the graph). ``params``: the tensors to call it with
    for its parameters (``torch.func.functional_call``). Logits that are still not one row
    per token are refused."""
    takes = inspect.signature(model.forward).parameters
    _refuse_required(model, takes, extra)
    if "use_cache" in takes:
        extra = {**extra, "use_cache": False}

    def call(kwargs: dict[str, Any]) -> torch.Tensor:
        with masks_as_exported(model):
            if params is None:
                return logits_of(model(input_ids, **kwargs))
            return logits_of(torch.func.functional_call(model, params, (input_ids,), kwargs))

    def per_token(logits: torch.Tensor) -> bool:
        return logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(input_ids.shape)

    logits, twice = call(extra), False
    name = next((k for k in ("targets", "labels") if k in takes and k not in extra), None)
    if not per_token(logits) and name is not None:
        logits, twice = call({**extra, name: labels.clamp(min=0)}), True
    if not per_token(logits):
        raise AutopartError(
            f"the model returned logits of shape {tuple(int(d) for d in logits.shape)} for "
            f"input_ids of shape {tuple(int(d) for d in input_ids.shape)}: autopart needs one "
            "row of logits per token, (batch, seq, vocab)",
            hint="return the logits of every position (a forward that computes only the last "
            "one for generation, as nanoGPT's, is called again with the labels as its targets "
            "or labels argument, if it takes one)",
        )
    return logits, twice


@contextlib.contextmanager
def masks_as_exported(model: nn.Module) -> Iterator[None]:
    """Hugging Face builds its attention masks under ``torch.export`` but skips them in an
    eager call (SDPA's ``is_causal``, keys grouped by ``enable_gqa``), which sums in another
    order. Every eager call of autopart's (``verify``'s reference, the own-loss check) builds
    them too, as the captured graph does, so the reference rounds as the graph on one device
    and ``verify`` measures what a plan changes: Llama's float32 RMSNorm inside a float64
    model turned the two calls' float64 round-off into a 2.5e-8 embedding-gradient difference
    at 8 layers × 1024 tokens, with no plan at all. Other models: nothing changes."""
    masking = sys.modules.get("transformers.masking_utils")
    exporting = getattr(masking, "is_torchdynamo_exporting", None)
    if not is_hugging_face(model) or exporting is None:
        yield
        return
    masking.is_torchdynamo_exporting = lambda: True  # type: ignore[union-attr]
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting = exporting  # type: ignore[union-attr]


def _refuse_required(
    model: nn.Module, takes: Mapping[str, inspect.Parameter], extra: Mapping[str, Any]
) -> None:
    """Refuse a ``forward`` with a required argument past the token ids that autopart does not
    pass (``forward(idx, targets)`` returning only its loss): it is called with the token ids
    and the batch's optional tensors by name, and trains the cross entropy of the logits."""
    params = list(takes.values())[1:]
    for p in params:
        required = p.default is inspect.Parameter.empty and p.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        if required and p.name not in extra:
            raise AutopartError(
                f"{type(model).__name__}.forward requires {p.name!r}, which autopart does not "
                "pass: it calls model(input_ids) (with attention_mask / position_ids by name when "
                "the batch has them) and trains the next-token cross entropy of the logits the "
                "model returns; the model's own loss is not used",
                hint=f"give {p.name} a default (forward(idx, {p.name}=None), as nanoGPT does) "
                "and return the logits, (logits, loss) or an object with .logits",
            )


class _LossSum(nn.Module):
    """``model`` plus the default loss: summed next-token CE over labels != -100."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        # set while tracing: ``vocab_size`` and ``twice`` (the model was called again, with the
        # labels: ``_called``); export puts back attributes that existed before it traced

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # the optional batch tensors go to the model by name, exactly those the example has
        given = {"attention_mask": attention_mask, "position_ids": position_ids}
        extra = {k: v for k, v in given.items() if v is not None}
        logits, self.twice = _called(self.model, input_ids, labels, None, extra)  # (b, s, V)
        self.vocab_size = int(logits.shape[-1])
        flat = logits.reshape(-1, logits.shape[-1])  # (b·s, V)
        if flat.dtype in LOW_PRECISION:  # the loss in float32 (and its softmax statistics)
            flat = flat.float()
        return F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction="sum")


LOW_PRECISION = (torch.bfloat16, torch.float16)


def capture_mixed(
    model: nn.Module,
    example_inputs: Batch,
    dtype: torch.dtype = torch.bfloat16,
) -> Captured:
    """Capture ``model`` computing in ``dtype`` with its own (float32) parameters as masters:
    the graph is a ``dtype`` copy's (every cast the model makes, such as Llama's float32 rotary
    tables, as it makes them in ``dtype``; the loss in float32), and ``Captured.params`` are
    ``model``'s parameters, which the runtime casts to ``dtype`` on the way in, so gradients
    flow back into, and accumulate in, the masters' dtype."""
    low = copy.deepcopy(model).to(dtype)
    captured = capture(low, example_inputs)
    masters = dict(model.named_parameters())
    captured.params = {f: masters[f] for f in captured.params}
    return captured


DATA_NAMES = ("input_ids", "labels", "attention_mask", "position_ids")
OPTIONAL = DATA_NAMES[2:]  # the optional batch tensors, passed to the model by name
Batch = tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]


def batch_fields(batch: Any) -> dict[str, torch.Tensor]:
    """A checked batch (``check_batch``) as ``{name: tensor}``: ``input_ids``, ``labels`` and
    the optional tensors it has, in ``DATA_NAMES`` order."""
    if isinstance(batch, dict):
        return {k: batch[k] for k in DATA_NAMES if batch.get(k) is not None}
    input_ids, labels = batch
    return {"input_ids": input_ids, "labels": labels}


def check_batch(example_inputs: Any) -> Batch:
    """Validate a batch: ``(input_ids, labels)``, two int64 tensors of the same (batch, seq)
    shape, or a mapping with those two keys and optionally ``attention_mask`` (1 = a real
    token, 0 = padding; int64 or bool, returned as int64) and ``position_ids`` (int64, ≥ 0), of
    the same shape. A pair comes back as a pair, a mapping as a dict of exactly the tensors
    given (a key set to None is left out)."""
    if isinstance(example_inputs, Mapping):
        unknown = sorted(set(example_inputs) - set(DATA_NAMES))
        if unknown:
            raise AutopartError(
                f"the batch has an unknown entry {unknown[0]!r}",
                hint=f"a batch holds {', '.join(DATA_NAMES)} (the last two optional)",
            )
        missing = [k for k in DATA_NAMES[:2] if example_inputs.get(k) is None]
        if missing:
            raise AutopartError(f"the batch has no {missing[0]}", hint=_BATCH_HINT)
        fields = {k: example_inputs[k] for k in DATA_NAMES if example_inputs.get(k) is not None}
    elif isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 2:
        fields = dict(zip(DATA_NAMES[:2], example_inputs, strict=True))
    else:
        raise AutopartError(
            "example_inputs must be (input_ids, labels) or a dict of the batch's tensors",
            hint=_BATCH_HINT,
        )
    input_ids, labels = fields["input_ids"], fields["labels"]
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 2:
            raise AutopartError(
                f"{name} must be an int64 tensor of shape (batch, seq), got {_what(t)}",
                hint="token ids as torch.long, e.g. torch.randint(0, vocab, (8, 128))",
            )
    if input_ids.shape != labels.shape:
        raise AutopartError(
            f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} differ in shape",
            hint="labels[i, t] is the target for input_ids[i, t] (already shifted)",
        )
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 2:
        raise AutopartError(
            f"example batch {tuple(input_ids.shape)} is too small to keep the sequence symbolic",
            hint="capture with a sequence of ≥ 2 tokens (torch.export specializes sizes 0 and 1)",
        )
    for name in OPTIONAL:
        if name in fields:
            fields[name] = check_extra(name, fields[name], tuple(input_ids.shape))
    if not isinstance(example_inputs, Mapping):
        return input_ids, labels
    return fields


_BATCH_HINT = (
    "pass (input_ids, labels), or {'input_ids': ..., 'labels': ..., 'attention_mask': ..., "
    "'position_ids': ...} (the last two optional); labels are next-token targets aligned "
    "with input_ids, -100 where ignored"
)


def _what(t: Any) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_extra(name: str, t: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """An optional batch tensor checked against the ids' ``shape``: ``attention_mask`` as int64
    0/1 (a bool mask is converted), ``position_ids`` int64 ≥ 0. Values are read, so call it on
    real tensors only (a meta tensor's shape and dtype are checked)."""
    kinds = (torch.int64, torch.bool) if name == "attention_mask" else (torch.int64,)
    if not isinstance(t, torch.Tensor) or t.dtype not in kinds or tuple(t.shape) != shape:
        want = "int64 or bool" if name == "attention_mask" else "int64"
        raise AutopartError(
            f"{name} must be a {want} tensor of the ids' shape {shape}, got {_what(t)}",
            hint="attention_mask: 1 for a real token, 0 for padding; position_ids: each "
            "token's position in its document (restarting at 0 for packed documents)",
        )
    if name == "attention_mask":
        t = t.to(torch.int64)
    if t.device.type != "meta":
        bad = ((t != 0) & (t != 1)) if name == "attention_mask" else (t < 0)
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise AutopartError(
                f"{name}[{i}, {j}] = {int(t[i, j])} is not "
                + ("0 or 1" if name == "attention_mask" else "a position (≥ 0)"),
                hint="attention_mask: 1 for a real token, 0 for padding; position_ids: "
                "each token's position in its document",
            )
    return t


def capture(model: nn.Module, example_inputs: Batch, roll: bool = True) -> Captured:
    """Export ``model`` (real or meta device) into an annotated functional graph. The example
    batch's optional tensors (``attention_mask``, ``position_ids``) are passed to the model by
    name and become data inputs of the graph; the model's ``forward`` must take them.
    ``roll`` (default): where export fixed the sequence length (a Python loop over the tokens),
    roll the loop back up so the graph fits any length (``autopart.frontend.loops``); False
    keeps export's graph as it is."""
    fields = batch_fields(check_batch(example_inputs))
    accepts(model, [k for k in fields if k in OPTIONAL])
    _refuse_backward_hooks(model)
    input_ids = fields["input_ids"]
    device = next((p.device for p in model.parameters()), input_ids.device)
    # on the model's device (CPU tokens, a meta model), and each its own tensor: export guards
    # a view's base (``ids[:, :-1]``), a guard the graph cannot check once retraced
    fields = {
        k: t.to(device).clone(memory_format=torch.contiguous_format) for k, t in fields.items()
    }
    wrapper = _LossSum(model)
    dyn = {0: Dim.AUTO, 1: Dim.AUTO}
    # torch.export specializes a size of 1: a batch of one sequence (micro-batch 1, as the
    # largest runs use) is traced as two copies of it, so the batch stays symbolic
    if input_ids.shape[0] == 1:
        fields = {k: t.repeat(2, 1) for k, t in fields.items()}
    _refuse_own_loss(model, fields)
    _warn_packing(model, fields)
    args = (fields["input_ids"], fields["labels"])
    kwargs = {k: t for k, t in fields.items() if k in OPTIONAL}
    try:
        ep = torch.export.export(
            wrapper,
            args,
            kwargs,
            dynamic_shapes={k: dyn for k in fields},
            strict=False,
        )
        table = {n.target: _SPLIT_UP[n.target] for n in ep.graph.nodes if n.target in _SPLIT_UP}
        table.update(library_decompositions(ep.graph))
        if table or any(
            _mutates(n)
            for g in ep.graph_module.modules()  # and inside grad-mode regions (``@no_grad``)
            if isinstance(g, fx.GraphModule)
            for n in g.graph.nodes
        ):
            # in-place ops (Falcon's ``x += ...``, slice assignments ``q[..., :d] = ...``): the
            # passes and the saved program need a functional graph; functionalizing with a table
            # of only these ops decomposes them (and the ``copy`` of a slice assignment, which
            # has no derivative, into ops that have one) and nothing else
            ep = ep.run_decompositions({**table, torch.ops.aten.copy.default: _copy})
    except AutopartError:
        raise
    except Exception as exc:  # noqa: BLE001 - every export failure becomes a readable one
        raise _explain(exc) from exc
    _refuse_state_updates(ep)
    if wrapper.twice:  # the first call's nodes and the model's own loss (``_called``)
        remove_dead(ep.graph_module)
    else:  # values nothing reads (a loss the model computes and does not return): one loss
        ep.graph_module.graph.eliminate_dead_code()
    ep.graph_module.recompile()
    captured = _annotate(ep, model, input_ids, wrapper.vocab_size)
    if roll:
        generalize_loops(captured, wrapper, {"input_ids": args[0], "labels": args[1], **kwargs})
        if fixed_length(captured.graph) is not None:
            return _frozen_floats(_unfixed(captured, model, fields))
    return _frozen_floats(captured)


def _float_of_sizes(expr: sympy.Expr) -> bool:
    """Does a shape guard compare a float computed from sizes (``8.0 / s``, ``math.sqrt(s)``)?"""
    return any(
        "Float" in type(f).__name__
        or "TrueDiv" in type(f).__name__
        or type(f).__name__.startswith("OpaqueUnaryFn")
        for f in expr.atoms(sympy.Function)
    )


def _frozen_floats(captured: Captured) -> Captured:
    """A Python float the model computes from the sequence length or the batch size and hands
    to an op as a number (``sdpa(..., scale=4.0 / s)``, ``layer_norm(eps=8.0 / s)``) is kept in
    the graph as the example's value: torch.export records only a guard on it, and leaves the
    length symbolic. A step of another length computed with the example's value, silently
    (loss 4e-4 off at 16 tokens). Such a guard fixes the length to the example's (a step of
    another is refused with the guard named); one on the batch size is refused, since a
    micro-batch or a dp replica's share runs the graph on fewer rows."""
    env = next(
        (
            d.node.shape_env
            for n in captured.graph.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)
            for d in n.meta["val"].shape
            if isinstance(d, torch.SymInt)
        ),
        None,
    )
    if env is None:
        return captured
    names = captured.graph.meta.get(META_SYMBOLS, {})
    for guard in env.guards:
        if not _float_of_sizes(guard.expr):
            continue
        dims = {names.get(x) for x in guard.expr.free_symbols}
        said = str(
            guard.expr.xreplace({x: names[x] for x in guard.expr.free_symbols if x in names})
        )
        said = re.sub(r"ToFloat\((\w+)\)", r"\1", said)
        said = re.sub(r"(?:Float|Int)TrueDiv\(([^,()]+), ([^,()]+)\)", r"\1/\2", said)
        said = re.sub(r"^Eq\((.+), ([^,]+)\)$", r"\1 = \2", said)
        if B in dims:
            raise AutopartError(
                f"the model computes a number from the batch size and torch.export kept its "
                f"example value ({said}): a micro-batch or a data-parallel share runs on fewer "
                "rows and would use the example's value",
                hint="compute it from a tensor (x.new_tensor(x.shape[0]) ...) or leave the "
                "batch size out of it",
            )
        if S in dims:
            s0 = captured.example_shape[1]
            why = (
                f"the model computes a number from the sequence length and torch.export kept "
                f"its value at {s0} tokens ({said})"
            )
            captured.seq_floor = captured.seq_limit = (s0, why)
    return captured


OWN_LOSS_RTOL = 1e-5  # the model's float32 loss of float64 logits differs by ~1e-8
OWN_LOSS_TOKENS = 64  # the own-loss check calls the model on the example's first row, this long


def _refuse_own_loss(model: nn.Module, fields: dict[str, torch.Tensor]) -> None:
    """Refuse a model whose own loss, given the labels, is not the mean next-token cross entropy
    of its logits, which is what autopart trains: label smoothing, a router's auxiliary loss
    (``output_router_logits=True``), a z-loss. The one-process loop ``model(ids,
    labels=labels).loss.backward()`` trains that loss; the ranks would silently train another
    (the loss 4.18 against 4.38, the router's gradients 89 % off). One call with the example's
    labels (its first row's first ``OWN_LOSS_TOKENS`` tokens; the whole example when those
    cannot be compared), with torch's generator put back, compares the loss it returns
    with the cross entropy of the logits it returns with it, the labels paired with the logits
    either as they are or shifted by one as Hugging Face models pair them (the example's labels
    may come in either convention); it must equal one of the two, and have its gradient with
    respect to the logits (label smoothing of uniform logits has the value, not the gradient).
    The labels go in as ``labels``
    or, for a model that takes no ``labels``, as ``targets`` (nanoGPT's ``forward(idx,
    targets)``: a loss plus a router's auxiliary term, stored on a module, was trained without
    the term). A model that takes neither, returns no loss, fails with these labels (a loss ignoring -1, not -100) or is on
    the meta device is not checked."""
    takes = inspect.signature(model.forward).parameters
    name = next((k for k in ("labels", "targets") if k in takes), None)
    if name is None or any(p.is_meta for p in model.parameters()):
        return
    # the first row, cut to OWN_LOSS_TOKENS, is the cheap call (the whole example through a
    # large model with gradients costs a forward's activations, 33 s of a 16-layer Llama's
    # 100 s compile at 4 × 1024 tokens); the whole example when that one cannot be compared
    first = {k: v[:1, :OWN_LOSS_TOKENS] for k, v in fields.items()}
    for batch in (first, fields):
        called = _call_with_labels(model, name, batch, "use_cache" in takes)
        if called is not None:
            break
    else:
        return
    out, logits, labels = called
    own = _loss_of(out, logits)
    if own is None:
        return
    own_value = float(own.detach())
    as_name = "" if name == "labels" else f" as {name}"
    pairings = [(logits, labels), (logits[:, :-1], labels[:, 1:])]  # as given; shifted by one
    ours = [
        (x, y, F.cross_entropy(x.float().flatten(0, 1), y.flatten(), ignore_index=-100))
        for x, y in pairings
        if bool((y != -100).any())
    ]
    if not ours:
        return
    values = [float(ce.detach()) for _, _, ce in ours]
    same = [
        ce
        for (_, _, ce), v in zip(ours, values, strict=True)
        if abs(own_value - v) <= OWN_LOSS_RTOL * abs(v)
    ]
    if same:
        # the same value can hide another loss: label smoothing of uniform logits (a head
        # initialised at zero) equals the cross entropy there, not its gradient. Nearly uniform
        # logits give both pairings the same value too: the loss is the cross entropy if its
        # gradient is that of either (Moshi's, at random init, was refused by the other's)
        whys = [_other_gradient(own, ce, logits) for ce in same]
        if None in whys:
            return
        why = whys[0]
        raise AutopartError(
            f"{type(model).__name__}'s own loss, given the labels{as_name}, equals the mean "
            f"next-token cross entropy of its logits ({own_value:.6g}) but not its gradient "
            f"({why}): autopart trains the cross entropy, and the model's loss is another "
            "(label smoothing, a z-loss) that happens to take the same value here",
            hint="train the plain cross entropy: turn the extra term off (label_smoothing=0), "
            "or compare against a one-process loop that uses F.cross_entropy on the logits",
        )
    nearest = min(values, key=lambda v: abs(v - own_value))
    raise AutopartError(
        f"{type(model).__name__}'s own loss, given the labels{as_name}, is {own_value:.6g}, but the mean "
        f"next-token cross entropy of its logits is {nearest:.6g}: autopart trains the cross "
        "entropy, and the model's loss adds something to it (label smoothing, a router's "
        "auxiliary loss, a z-loss), which the ranks would silently leave out",
        hint="train the plain cross entropy: turn the extra term off (label_smoothing=0, "
        "output_router_logits=False), or compare against a one-process loop that uses "
        "F.cross_entropy on the logits",
    )


def _call_with_labels(
    model: nn.Module, name: str, batch: dict[str, torch.Tensor], no_cache: bool
) -> tuple[Any, torch.Tensor, torch.Tensor] | None:
    """``model(input_ids, <name>=labels, ...)`` with torch's generators put back after: its
    output, logits and the labels, or None when the labels cannot be compared there (all
    ignored, an exception, logits of another shape)."""
    labels = batch["labels"]
    if not bool((labels != -100).any()):
        return None
    extra: dict[str, Any] = {k: v for k, v in batch.items() if k in OPTIONAL}
    if no_cache:
        extra["use_cache"] = False
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=cuda_devices(model)):
            out = model(batch["input_ids"], **{name: labels}, **extra)
            logits = logits_of(out)
    except Exception:  # noqa: BLE001 - labels it cannot take (or a length): not compared
        return None
    if tuple(logits.shape[:2]) != tuple(labels.shape):
        return None
    return out, logits, labels


def _other_gradient(own: torch.Tensor, ce: torch.Tensor, logits: torch.Tensor) -> str | None:
    """How the gradients of ``own`` and ``ce`` with respect to ``logits`` differ, or None
    when they agree (or cannot be compared: no graph to the logits)."""
    if not (own.requires_grad and ce.requires_grad and logits.requires_grad):
        return None
    g_own = torch.autograd.grad(own, logits, retain_graph=True, allow_unused=True)[0]
    g_ce = torch.autograd.grad(ce, logits, allow_unused=True)[0]
    if g_own is None or g_ce is None:
        return None
    scale = float(g_ce.abs().max())
    diff = float((g_own.to(g_ce.dtype) - g_ce).abs().max())
    if scale == 0 or diff <= OWN_LOSS_RTOL * 10 * scale:
        return None
    return f"the gradients with respect to the logits differ by {diff / scale:.2g} of the largest"


def is_hugging_face(model: nn.Module) -> bool:
    """Is ``model`` a Hugging Face ``transformers`` model (labels unshifted, a K/V cache)?
    Seen through ``torch.compile``'s wrapper (``OptimizedModule._orig_mod``), which a loop
    may have made before ``parallelize``."""
    inner = getattr(model, "_orig_mod", None) if type(model).__name__ == "OptimizedModule" else None
    return type(inner if isinstance(inner, nn.Module) else model).__module__.startswith(
        "transformers."
    )


def label_layout(input_ids: torch.Tensor, labels: torch.Tensor) -> str | None:
    """How ``labels`` plainly read against ``input_ids``: "shifted" (``labels[:, t] ==
    input_ids[:, t + 1]`` wherever kept), "unshifted" (Hugging Face's ``labels = input_ids``),
    "both" (a token repeated along every row), or None (neither, or fewer than 8 labels to tell
    a convention from chance). -100 is ignored."""
    keep = labels != -100
    if input_ids.shape != labels.shape or input_ids.dim() != 2 or int(keep.sum()) < 8:
        return None
    inner = keep[:, :-1]
    shifted = int(inner.sum()) >= 8 and bool((labels[:, :-1] == input_ids[:, 1:])[inner].all())
    unshifted = bool((labels == input_ids)[keep].all())
    if shifted and unshifted:
        return "both"
    return "shifted" if shifted else "unshifted" if unshifted else None


def _warn_packing(model: nn.Module, fields: dict[str, torch.Tensor]) -> None:
    """Packed documents (``position_ids`` and no ``attention_mask``) in a Hugging Face model
    that keeps a K/V cache by default: autopart calls it with ``use_cache=False``, with which
    it masks the documents apart; its default call builds a cache and attends across them."""
    config = getattr(model, "config", None)
    if (
        is_hugging_face(model)
        and "position_ids" in fields
        and "attention_mask" not in fields
        and getattr(config, "use_cache", False)
    ):
        warnings.warn(
            f"{type(model).__name__} with position_ids and no attention_mask: autopart calls "
            "it with use_cache=False, with which Hugging Face masks packed documents (positions "
            "restarting at 0) apart; its default call (config.use_cache=True) builds a K/V "
            "cache and then attends across the documents, so a one-process loop that checks "
            "autopart must call model(..., use_cache=False) too (or set "
            "config.use_cache = False)",
            UserWarning,
            stacklevel=3,
        )


def _loss_of(out: Any, logits: torch.Tensor) -> torch.Tensor | None:
    """The loss a model returned beside its logits: ``.loss``, ``["loss"]``, or the one
    scalar floating tensor of a tuple; None if none."""
    if isinstance(out, Mapping):
        found = out.get("loss")
    elif hasattr(out, "loss"):
        found = out.loss
    elif isinstance(out, (tuple, list)):
        scalars = [
            t
            for t in out
            if isinstance(t, torch.Tensor)
            and t is not logits
            and t.dim() == 0
            and t.is_floating_point()
        ]
        found = scalars[0] if len(scalars) == 1 else None
    else:
        found = None
    return found if isinstance(found, torch.Tensor) and found.numel() == 1 else None


def cuda_devices(model: nn.Module) -> list[int]:
    """The CUDA devices ``model``'s parameters are on (their generators to put back)."""
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _refuse_state_updates(ep: torch.export.ExportedProgram) -> None:
    """Refuse a model whose forward updates its buffers (BatchNorm's running statistics in
    training mode, a step counter): the programs compute the loss and the gradients only, so
    every rank would drop the update (and the graph's extra outputs crashed the backward inside
    every rank). A buffer the forward overwrites before any read of it (Phi-3's longrope picks
    its frequencies per call: ``inv_freq.copy_(where(...))``) is scratch space: no step reads
    what an earlier one left there, so its update is dropped from the graph's outputs."""
    sig = ep.graph_signature
    out = next(n for n in ep.graph.nodes if n.op == "output")
    placeholder = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    read = {
        spec.target
        for spec in sig.input_specs
        if spec.kind == InputKind.BUFFER and placeholder[spec.arg.name].users
    }
    kept, stateful = [], set()
    for spec, value in zip(sig.output_specs, cast(tuple, out.args[0]), strict=True):
        if spec.kind != OutputKind.BUFFER_MUTATION:
            kept.append(value)
        elif spec.target in read:
            stateful.add((spec.target or "").removeprefix(_PREFIX))
    if not stateful:
        out.args = (tuple(kept), *out.args[1:])
        ep.graph_module.recompile()
    updated = sorted(stateful)
    if updated:
        where = ", ".join(updated[:4]) + (
            f" and {len(updated) - 4} more" if len(updated) > 4 else ""
        )
        raise AutopartError(
            f"the model updates {len(updated)} buffer(s) in its forward: {where} (module "
            f"{updated[0].rpartition('.')[0] or 'the model itself'}); autopart's programs compute the "
            "loss and the gradients only, so every rank would drop the update",
            hint=(
                "spectral_norm updates its power iteration's vectors in every training call: "
                "use torch.nn.utils.parametrizations.weight_norm, or a norm of the weight "
                "computed without state"
                if any(".parametrizations." in u for u in updated)
                else "keep state updates out of forward: BatchNorm in eval mode or a "
                "LayerNorm / RMSNorm, a step counter in the training loop"
            ),
        )


def _unfixed(captured: Captured, model: nn.Module, fields: dict[str, torch.Tensor]) -> Captured:
    """When export fixed the sequence length (and no loop over the tokens was rolled up): the
    example's length may be the size of a table the model slices, ``mask[:, :, :T, :T]`` of a
    ``block_size`` buffer at ``T = block_size``, where the slice is the whole table and export
    specializes the length to it (nanoGPT's attention without flash, ``nn.MultiheadAttention``
    with a sliced mask). The graph would then fit that length only, and a shorter step fail in
    every rank. The model is captured once more at a shorter length (``length - 2^k``, 2^k
    the largest power of two dividing it and at most half of it): if the length stays
    symbolic there and the graph fits the example's length, that capture
    is kept, with the example's shape. Else export's fixed graph stays (``Plan.min_seq`` and
    ``max_seq`` then hold a step to its length)."""
    length = captured.example_shape[1]
    # shorter by the largest power of two that divides the length (at most half of it): the
    # graph's symbolic sizes carry the capture's length as their hint, and a length that tp or
    # a scan's blocks divide must stay divisible (an odd one failed sequence parallelism)
    step = length & -length
    n = length - max(1, step if step <= length // 2 else step // 2)
    if n < 2:
        return captured
    try:
        again = capture(model, {k: t[:, :n] for k, t in fields.items()}, roll=False)
    except AutopartError:
        return captured
    if fixed_length(again.graph) is None and holds_at(again.graph, 2, length) is None:
        again.example_shape = captured.example_shape
        return again
    return captured


def generalize_loops(
    captured: Captured, wrapper: nn.Module, batch: dict[str, torch.Tensor]
) -> None:
    """When export fixed the length of ``input_ids`` because the model loops over its tokens
    (``autopart.frontend.loops``), keep the rolled-up graph instead, if it computes the
    model's loss at the example's length and at two others (tokens repeated to that length);
    else keep export's (Seq1F1B then refuses it, naming the fixed length). Where the rolled
    graph fails that, the example's length may also be a width of the model (32 tokens and a
    hidden size of 32: which 32 is the length?), so the model is captured once more, at a
    longer length that no size of the graph has, nor 2 to 8 times it (the shortest multiple
    of 8 if one is free),
    and rolled up from there, where a buffer cut to that length (nanoGPT's causal mask) is cut
    to any length (``reroll``'s ``tables``). A model
    on the meta device cannot be run, so its graph stays as export made it."""
    length = fixed_length(captured.graph)
    if length is None or any(p.device.type == "meta" for p in captured.params.values()):
        return
    why = _rolled(captured, captured.graph, length, wrapper, batch)
    if why is None or "recognizes" in why:
        _record(captured, why)
        return
    taken = _sizes_in(captured.graph)
    # free: no size of the graph is the length or a small multiple of it (``reroll`` reads
    # b · 2S, the batch times the length times two slots, as the length's)
    free = [
        n
        for n in range(length + 1, 9 * length + len(taken) + 9)
        if not any(k * n in taken for k in range(1, 9))
    ]
    other = min(free, key=lambda n: (n % 8 != 0, n))  # a multiple of 8 if one is free
    try:
        again = capture(cast(nn.Module, wrapper.model), _repeated(batch, length, other), roll=False)
    except AutopartError as exc:
        _record(captured, f"{why}; captured at {other} tokens: {exc.message}")
        return
    second = (
        _rolled(captured, again.graph, other, wrapper, batch, tables=True)
        if fixed_length(again.graph) == other
        else "its length was not fixed there"
    )
    _record(captured, None if second is None else f"{why}; captured at {other} tokens: {second}")


def _record(captured: Captured, why: str | None) -> None:
    """Keep the outcome on the capture, and why not on its graph (Seq1F1B's refusal says it)."""
    captured.loops = why or "rolled up"
    if why:
        captured.graph.meta[META_LOOPS] = why


def _rolled(
    captured: Captured,
    graph: fx.GraphModule,
    length: int,
    wrapper: nn.Module,
    batch: dict[str, torch.Tensor],
    tables: bool = False,
) -> str | None:
    """Roll ``graph`` (export's, at ``length`` tokens) up and check it against the model at
    the example's length and two others; on success it becomes ``captured.graph`` (None),
    else why not. ``tables``: ``reroll``'s (at a length no width of the model has)."""
    try:
        rolled = reroll(graph, length, tables)
    except Exception as exc:  # noqa: BLE001 - a loop autopart misread: keep export's graph
        rolled = f"rolling it up failed ({type(exc).__name__}: {str(exc)[:200]})"
    if isinstance(rolled, str):
        return rolled
    low = captured.dtype in LOW_PRECISION
    example = captured.example_shape[1]
    for n in (example, example + 8, max(2, example // 2)):
        cut = _repeated(batch, example, n)
        try:
            with torch.no_grad():
                want = wrapper(**cut)
                got = rolled(*_feeds(rolled, captured, cut))[0]
        except Exception as exc:  # noqa: BLE001 - either fails at that length: not proven
            return f"at {n} tokens: {type(exc).__name__}: {str(exc)[:200]}"
        if not torch.allclose(got.double(), want.double(), rtol=1e-2 if low else 1e-5):
            return (
                f"the rolled-up graph's loss at {n} tokens is {float(got):.6g}, the model's "
                f"{float(want):.6g}"
            )
    rolled.meta.update({key: v for key, v in captured.graph.meta.items() if key not in rolled.meta})
    _name_symbols(rolled)
    captured.graph = rolled
    return None


def _repeated(batch: dict[str, torch.Tensor], length: int, n: int) -> dict[str, torch.Tensor]:
    """The batch's tokens repeated along the sequence and cut to ``n``."""
    return {k: t.repeat(1, n // length + 1)[:, :n] for k, t in batch.items()}


def _sizes_in(gm: fx.GraphModule) -> set[int]:
    """Every int of the graph: its nodes' integer arguments and fixed sizes."""
    out: set[int] = set()
    for n in gm.graph.nodes:
        stack: list[Any] = [*n.args, *n.kwargs.values()]
        val = n.meta.get("val")
        stack += list(val.shape) if isinstance(val, torch.Tensor) else []
        while stack:
            a = stack.pop()
            if isinstance(a, (list, tuple)):
                stack.extend(a)
            elif isinstance(a, int) and not isinstance(a, bool):
                out.add(a)
    return out


def _feeds(gm: fx.GraphModule, captured: Captured, batch: dict[str, torch.Tensor]) -> list:
    """``gm``'s inputs, in placeholder order, from ``captured``'s tensors and ``batch``."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        ref = n.meta[META_INPUT]
        if ref.kind == "param":
            out.append(captured.params[ref.name])
        elif ref.kind == "data":
            out.append(batch[ref.name])
        else:
            out.append(captured.buffers[ref.name])
    return out


def _refuse_backward_hooks(model: nn.Module) -> None:
    """Refuse a module with backward hooks (``register_full_backward_hook``,
    ``register_full_backward_pre_hook``): torch.export traces the forward only, so the
    program's backward would run without them (a hook scaling a block's gradient was dropped
    without a word: weights 9× off). Forward hooks are traced into the graph and kept."""
    for name, m in model.named_modules():
        if m._backward_hooks or m._backward_pre_hooks:
            raise AutopartError(
                f"module {name or '<root>'} ({type(m).__name__}) has a backward hook: "
                "torch.export captures the forward only, so the compiled program's backward "
                "would not run it",
                hint="remove the backward hook before parallelize: autopart trains the "
                "gradients of the forward as captured (change gradients after runner.step(), "
                "before the optimizer, instead)",
            )


def accepts(model: nn.Module, names: list[str]) -> None:
    """Refuse optional batch tensors the model's ``forward`` does not name as a parameter (a
    ``**kwargs`` catch-all may drop them silently, so it does not count)."""
    params = inspect.signature(model.forward).parameters
    for name in names:
        if name not in params:
            raise AutopartError(
                f"the batch has {name}, but {type(model).__name__}.forward takes no {name} "
                "argument",
                hint=f"leave {name} out of the batch, or give the model a forward that takes "
                f"{name} (Hugging Face causal LMs take attention_mask and position_ids)",
            )


def _baddbmm(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1):
    out = torch.bmm(a, b)
    out = out if alpha == 1 else out * alpha
    return out + (x if beta == 1 else x * beta)


# fused ops the passes see as their parts: BLOOM's ``alibi.baddbmm(q, kᵀ)`` becomes a bmm the
# tp rules and attention recognition know, plus a bias (and fake propagation of baddbmm with a
# broadcast, symbolic ``self`` fails on re-propagation in torch 2.13)
_SPLIT_UP = {torch.ops.aten.baddbmm.default: _baddbmm}


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy`` (what functionalizing ``dst[...] = src`` leaves): ``src`` broadcast to
    ``dst``'s shape and dtype. ``aten.copy`` has no autograd formula, so its backward failed
    inside every rank (DeepSeek-V3's and MiniCPM3's ``q[..., :d] = ...``); these ops have one."""
    return src.to(dtype=dst.dtype).expand(dst.shape).clone()


def _grouped_mm_by_expert(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """``transformers::grouped_mm_fallback`` in ATen: rows ``offs[e − 1] ≤ r < offs[e]`` of ``x``
    (sorted by expert) times ``weight[e]``. Every row is multiplied by each expert's weights and
    kept where it belongs (exact; E times the FLOPs of the grouped kernel)."""
    slot = torch.arange(x.shape[0], device=x.device)
    out = torch.zeros((), dtype=x.dtype, device=x.device)
    for e in range(weight.shape[0]):
        mine = slot < offs[e]
        if e:
            mine = mine & ~(slot < offs[e - 1])
        out = torch.where(mine.unsqueeze(-1), x @ weight[e], out)
    return out


# library custom ops with a known ATen form, by qualified name (an allow-list: every other op
# outside aten and autopart is decomposed only when torch knows a decomposition, else refused
# by compile_program, naming it)
LIBRARY_DECOMPOSITIONS: dict[str, Any] = {
    "transformers::grouped_mm_fallback": _grouped_mm_by_expert,
}


def library_decompositions(graph: fx.Graph) -> dict[Any, Any]:
    """op → its ATen decomposition, for the graph's ops outside the aten and autopart
    namespaces that have one: ``LIBRARY_DECOMPOSITIONS``, torch's decomposition table, or the
    op's own composite (CompositeImplicitAutograd) kernel."""
    from torch._decomp import decomposition_table

    out = {}
    for n in graph.nodes:
        op = n.target
        if not isinstance(op, torch._ops.OpOverload) or op.namespace in ("aten", "autopart"):
            continue
        if op.name() in LIBRARY_DECOMPOSITIONS:
            out[op] = LIBRARY_DECOMPOSITIONS[op.name()]
        elif op in decomposition_table:
            out[op] = decomposition_table[op]
        elif torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            from torch.export.decomp_utils import CustomDecompTable  # export's own CIA entries

            composite = CustomDecompTable()
            if op in composite:
                out[op] = composite[op]
    return out


def _mutates(n: fx.Node) -> bool:
    """An in-place or ``out=`` ATen op: its schema writes one of its arguments."""
    target = n.target
    return (
        n.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and (target._schema.is_mutable)
    )


def _annotate(
    ep: torch.export.ExportedProgram, model: nn.Module, input_ids: torch.Tensor, vocab: int
) -> Captured:
    gm = ep.graph_module
    names = dict(model.named_parameters())  # canonical (first) name of each tensor
    by_id = {id(t): fqn for fqn, t in names.items()}
    all_params = dict(model.named_parameters(remove_duplicate=False))
    tied = {f: by_id[id(t)] for f, t in all_params.items() if by_id[id(t)] != f}
    buffers: dict[str, torch.Tensor] = {}
    canonical: dict[str, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for spec, node in zip(ep.graph_signature.input_specs, placeholders, strict=True):
        target = (spec.target or "").removeprefix(_PREFIX)
        if spec.kind == InputKind.PARAMETER:
            fqn = tied.get(target, target)
            node.meta[META_INPUT] = InputRef("param", fqn)
            if fqn in canonical:  # an alias of a tied parameter: one logical placeholder
                node.replace_all_uses_with(canonical[fqn])
            else:
                canonical[fqn] = node
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            kind: InputRefKind = "buffer" if spec.kind == InputKind.BUFFER else "constant"
            node.meta[META_INPUT] = InputRef(kind, target)
            src = ep.state_dict if kind == "buffer" and spec.persistent else ep.constants
            buffers[target] = src.get(spec.target, ep.state_dict.get(spec.target))
        else:
            if node.name not in DATA_NAMES:
                raise AutopartError(f"capture made an unexpected graph input {node.name!r}")
            node.meta[META_INPUT] = InputRef("data", node.name)
    for node in placeholders:  # drop the aliases' now unused placeholders
        ref = node.meta[META_INPUT]
        if ref.kind == "param" and canonical[ref.name] is not node:
            gm.graph.erase_node(node)
    inline_grad_modes(gm)
    for node in gm.graph.nodes:
        path = _module_path(node)
        node.meta[META_MODULE] = path
        node.meta[META_LAYER] = layer_of(path)
    for fqn, node in canonical.items():
        node.meta[META_MODULE] = fqn.rpartition(".")[0]
        node.meta[META_LAYER] = layer_of(fqn)
    _blocks_only(gm)
    for node in gm.graph.nodes:  # p_model_transformer_wte_weight → transformer_wte_weight
        if node.op == "placeholder" and re.match(r"[pbc]_model_", node.name):
            node._rename(node.name[len("p_model_") :])
            node.target = node.name
    gm.graph.lint()
    gm.recompile()
    _name_symbols(gm)
    gm.meta[META_RANGES] = dict(ep.range_constraints)
    gm.meta[META_BUFFERS] = buffers  # their values: passes that evaluate masks need them
    params: dict[str, torch.Tensor] = {fqn: names[fqn] for fqn in canonical}
    return Captured(
        graph=gm,
        params=params,
        buffers=buffers,
        tied=tied,
        example_shape=(int(input_ids.shape[0]), int(input_ids.shape[1])),
        dtype=next(iter(params.values())).dtype if params else torch.float32,
        vocab_size=vocab,
        batch_names=tuple(
            n
            for n in DATA_NAMES
            if any(p.name == n for p in gm.graph.nodes if p.op == "placeholder")
        ),
    )


_GRAD_MODE = torch.ops.higher_order.wrap_with_set_grad_enabled


def inline_grad_modes(gm: fx.GraphModule) -> None:
    """Inline each ``wrap_with_set_grad_enabled(enabled, body, *args)`` (a ``torch.no_grad``
    region in the model, such as Llama's rotary tables): the body's nodes take its place, and
    with ``enabled=False`` each of its outputs is detached, which computes the same values and
    passes no gradient back, as the region did. The graph is then plain ATen: the passes see
    every node, and a saved stage graph holds no subgraphs."""
    for n in [n for n in gm.graph.nodes if n.target is _GRAD_MODE]:
        enabled, body_ref, *operands = n.args
        body = getattr(gm, body_ref.target)
        env = dict(
            zip([p for p in body.graph.nodes if p.op == "placeholder"], operands, strict=True)
        )
        outs: list[fx.Node] = []
        with gm.graph.inserting_before(n):
            for b in body.graph.nodes:
                if b.op == "placeholder":
                    continue
                if b.op == "output":
                    outs = [env[o] for o in b.args[0]]
                    break
                env[b] = gm.graph.node_copy(b, env.__getitem__)
            if not enabled:
                detached = []
                for o in outs:
                    d = gm.graph.call_function(torch.ops.aten.detach.default, (o,))
                    d.meta.update(o.meta)
                    detached.append(d)
                outs = detached
        for u in list(n.users):  # getitem(wrap, i) → the i-th output
            u.replace_all_uses_with(outs[u.args[1]])
            gm.graph.erase_node(u)
        gm.graph.erase_node(n)
        if not body_ref.users:
            gm.graph.erase_node(body_ref)
            delattr(gm, body_ref.target)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [p for p, _ in stack.values() if p.startswith("model")]
    return paths[-1].removeprefix("model").removeprefix(".") if paths else ""


_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def _blocks_only(gm: fx.GraphModule) -> None:
    """Keep ``META_LAYER`` for the model's list of blocks only. When module paths index more
    than one list (Gemma 3n's ``altup_projections.N`` run before ``layers.N``), the blocks are
    the list with the most nodes; the other lists' nodes belong to no block (a block index from
    them made the pipeline's units run out of order, and its split was refused)."""
    lists: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        m = _LAYER.search(n.meta.get(META_MODULE) or "")
        if m is not None and n.meta.get(META_LAYER) is not None:
            lists[n] = n.meta[META_MODULE][: m.start()]
    counts = Counter(lists.values())
    if len(counts) < 2:
        return
    blocks = counts.most_common(1)[0][0]
    for n, prefix in lists.items():
        if prefix != blocks:
            n.meta[META_LAYER] = None


def layer_of(path: str) -> int | None:
    """Block index of a module path: the first integer component (``transformer.h.3.attn`` → 3)."""
    m = _LAYER.search(path)
    return int(m.group(1)) if m else None


def _name_symbols(gm: fx.GraphModule) -> None:
    """Record in ``gm.meta`` which shape-env symbols are the batch (b) and sequence (s) dims."""
    subs: dict[sympy.Symbol, sympy.Symbol] = {}
    for node in gm.graph.nodes:
        ref = node.meta.get(META_INPUT)
        if ref is not None and ref.kind == "data":
            for dim, sym in zip(node.meta["val"].shape, (B, S), strict=False):
                # a size export specialized is a SymInt whose expression is a number
                # (RecurrentGemma's 32 tokens): naming it would turn every 32 into s
                if isinstance(dim, torch.SymInt) and dim.node.expr.is_Symbol:
                    subs[dim.node.expr] = sym
    gm.meta[META_SYMBOLS] = subs


def from_parameters(gm: fx.GraphModule) -> set[fx.Node]:
    """The floating-point values of ``gm`` computed from parameters: those that carry a
    gradient back (a float32 mask of ones, say, does not)."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]  # a chunk or split: its pieces
        if not any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals):
            continue
        ref = n.meta.get(META_INPUT)
        if (ref is not None and ref.kind == "param") or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def to_sympy(x: Any, gm: fx.GraphModule) -> sympy.Expr:
    """An int or SymInt of ``gm`` as a sympy expression in b and s."""
    if isinstance(x, torch.SymInt):
        return sympy.sympify(x.node.expr).xreplace(gm.meta.get(META_SYMBOLS, {}))
    return sympy.Integer(int(x))


_SKIP = (  # torch and autopart frames: the model line is the first frame in neither
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
)


def _explain(exc: BaseException) -> AutopartError:
    """Turn an export failure into an AutopartError quoting the model line where it stopped."""
    frames: list[traceback.FrameSummary] = []
    seen: BaseException | None = exc
    while seen is not None:
        frames = traceback.extract_tb(seen.__traceback__) + frames
        seen = seen.__cause__ or seen.__context__
    stdlib = os.path.dirname(os.__file__)
    user = [
        f
        for f in frames
        if not f.filename.startswith(_SKIP)
        and not (f.filename.startswith(stdlib) and "site-packages" not in f.filename)
        and f.filename != sys.argv[0]
    ]
    m = re.search(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)', str(exc))
    if m:
        where = f"{m.group(1)}:{m.group(2)} in {m.group(3)}\n    {m.group(4).strip()}"
    elif user:
        f = user[-1]
        line = (f.line or linecache.getline(f.filename, f.lineno or 0)).strip()
        where = f"{f.filename}:{f.lineno} in {f.name}\n    {line}"
    else:
        where = "(no model source line found in the traceback)"
    first = first_line(exc)
    data_dependent = "data-dependent" in str(exc) or "GuardOnDataDependent" in type(exc).__name__
    hint = (
        "the model branches on tensor values (data-dependent control flow); make the branch "
        "depend on shapes or config only, or use torch.cond / torch.where"
        if data_dependent
        else "make this line traceable by torch.export (non-strict): avoid Python work on "
        "tensor values, .item(), and numpy; for Hugging Face models pass use_cache=False"
    )
    distributions = os.path.join(os.path.dirname(torch.__file__), "distributions")
    if data_dependent and any(f.filename.startswith(distributions) for f in frames):
        hint = (  # BLT's entropy of a Categorical: the branch is torch's argument check
            "torch.distributions checks the values of a distribution's arguments when it is "
            "built (validate_args), a branch on tensor values: build it with "
            "validate_args=False, or call "
            "torch.distributions.Distribution.set_default_validate_args(False) before capture"
        )
    if "dynamic_frequency_update" in where:  # Hugging Face's rope_type="dynamic"
        hint = (
            'dynamic RoPE (rope_type "dynamic") rescales its frequencies from the largest '
            "position of each batch, a branch on tensor values that torch.export cannot keep: "
            'use a fixed scaling ("linear", "yarn", "llama3") or none'
        )
    return AutopartError(
        f"torch.export could not trace the model: {type(exc).__name__}: {first}\n"
        f"  tracing stopped at {where}",
        hint=hint,
    )
