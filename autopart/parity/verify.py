"""Verification as a feature: parity of a parallel plan with the single-device run.

``verify(spec, dp=2, ...)`` builds the model from its factory, computes the reference loss and
gradients on one device (mean next-token cross entropy over labels != -100), compiles and saves
the program, launches its ranks with torchrun (real gloo processes), runs one step, gathers
every rank's gradient shards back to the model's global parameter names and compares.
Passing means: loss and every gradient within ``rtol`` (float64: 1e-9, float32: 1e-5), where
the error of a tensor is ``max|got − ref| / max(max|ref|, FLOOR × largest gradient)``. A model
that computes some values in a lower precision than it runs in (``islands``: Gemma's float32
norms in a float64 model) is held to that precision's tolerance, and the report says where.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import autopart.scan  # noqa: F401 - registers autopart::linear_scan (island_dtypes)
from autopart.api import parallelize
from autopart.errors import AutopartError, first_line
from autopart.frontend.capture import (
    LOW_PRECISION,
    META_MODULE,
    B,
    S,
    batch_fields,
    capture,
    capture_mixed,
    from_parameters,
    model_logits,
    to_sympy,
)
from autopart.frontend.spec import Factory, build
from autopart.layout import SCHEDULES, SPLITS, Plan
from autopart.parity.checks import fork_ranks
from autopart.program.format import Shard
from autopart.runtime.launch import launch, launch_forked  # noqa: F401 - verify's API

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# "bfloat16" is the mixed-precision policy: bf16 compute, float32 masters and loss (both runs)
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Report:
    """Outcome of one parity check."""

    loss: float
    ref_loss: float
    loss_error: float
    grad_error: float
    worst: str  # the global FQN of the worst gradient
    tolerance: float
    errors: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    output: str = ""
    zero: list[str] = field(default_factory=list)  # gradients zero by construction (round-off)
    islands: list[str] = field(default_factory=list)  # "module (dtype)" computed at lower precision
    precision: str = ""  # the lowest of the islands' dtypes ("float32"), when there are islands
    saved: list[int] = field(default_factory=list)  # per rank: peak bytes saved for backward
    dropout: list[str] = field(default_factory=list)  # "module (p=…)": active in the capture

    @property
    def ok(self) -> bool:
        return self.loss_error <= self.tolerance and self.grad_error <= self.tolerance

    def __str__(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        return (
            f"{verdict}: loss {self.loss:.12g} vs single-device {self.ref_loss:.12g} "
            f"(rel err {self.loss_error:.2e}); worst gradient {self.worst} rel err "
            f"{self.grad_error:.2e}; tolerance {self.tolerance:.0e}"
            + (f" ({self._lower()})" if self.islands else "")
            + f"; {len(self.errors)} gradients compared"
            + (f" ({len(self.zero)} zero by construction, up to round-off)" if self.zero else "")
            + (f"; {self.dropout_note()}" if self.dropout_note() else "")
        )

    def dropout_note(self) -> str:
        """Why a FAIL of a model with active dropout says nothing about the program (empty
        for a PASS, or without dropout)."""
        if not self.dropout or self.ok:
            return ""
        more = ", …" if len(self.dropout) > 2 else ""
        return (
            f"the model has active dropout ({len(self.dropout)}: "
            f"{', '.join(self.dropout[:2])}{more}), whose masks the ranks draw otherwise than "
            "one device's generator: verify the model in eval mode (model.eval() in its factory)"
        )

    def _lower(self) -> str:
        """ "float32 inside the model: m.norm and 4 more modules"."""
        first = self.islands[0].rpartition(" (")[0]
        more = f" and {len(self.islands) - 1} more modules" if len(self.islands) > 1 else ""
        return f"{self.precision} inside the model: {first}{more}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def islands(gm: Any, dtype: torch.dtype) -> list[str]:
    """``island_dtypes`` as ``"module (dtype)"`` strings, in graph order."""
    return [f"{module} ({_name(d)})" for module, d in island_dtypes(gm, dtype)]


def island_dtypes(gm: Any, dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
    """Where a graph traced at ``dtype`` rounds at a lower precision in a way a plan can move:
    (module, dtype) for each module, in graph order. Counted, among values computed from
    parameters: a lower-precision value without batch or sequence dims (Gemma's
    and Cohere's norms multiply by ``weight.float()``, DiffLlama scales by a float32 lambda:
    their gradients are summed over tokens in float32) and a lower-precision op whose sums a
    plan reorders or recomputes (products, softmax, the loss: GPT-J's float32 attention
    scores), or a scan along the sequence with a lower-precision input or output (Seq1F1B
    continues it from the previous chunk's last value, so its backward's order moves). A
    float32 step applied token by token (Llama's RMSNorm statistics) rounds the same way in
    every plan."""
    aten = torch.ops.aten
    mixing = {
        aten.matmul.default,
        aten.bmm.default,
        aten.mm.default,
        aten.baddbmm.default,
        aten.linear.default,
        aten.addmm.default,
        aten.softmax.int,
        aten._softmax.default,
        aten.log_softmax.int,
        aten._log_softmax.default,
        aten.scaled_dot_product_attention.default,
        aten.cross_entropy_loss.default,
        aten.nll_loss_forward.default,
    }
    scans = {
        aten.cumsum.default,
        aten.cumprod.default,
        aten.logcumsumexp.default,
        aten.cummax.default,
        aten.cummin.default,
        torch.ops.autopart.linear_scan.default,
    }

    def tokens(x: Any) -> bool:
        """The value has a batch or sequence dim (its gradient is not summed over tokens)."""
        val = x.meta.get("val")
        return isinstance(val, torch.Tensor) and any(
            to_sympy(d, gm).free_symbols & {B, S} for d in val.shape
        )

    eps = torch.finfo(dtype).eps
    found: dict[tuple[str, torch.dtype], None] = {}
    trained = from_parameters(gm)
    for n in gm.graph.nodes:  # in graph order
        if n in trained and n.target in scans:  # cumprod(x.float(), dtype=float64), say
            vals = [a.meta.get("val") for a in n.all_input_nodes] + [n.meta.get("val")]
            floats = [
                v.dtype
                for v in _flat_vals(vals)
                if v.is_floating_point() and torch.finfo(v.dtype).eps > eps
            ]
            if floats:
                where = n.meta.get(META_MODULE) or "the model's own forward (no submodule)"
                found[(where, floats[0])] = None
            continue
        if (
            n not in trained
            or n.op != "call_function"
            or not isinstance(n.meta["val"], torch.Tensor)
        ):
            continue
        low = n.meta["val"].dtype
        if torch.finfo(low).eps <= eps:
            continue
        # lower precision where a plan moves the round-off: a product, softmax or loss (sums a
        # plan reorders), or a value without token dims (a parameter cast down, DiffLlama's
        # float32 lambda): its gradient, a sum over tokens, is rounded to this precision
        if n.target in mixing or not tokens(n):
            where = n.meta.get(META_MODULE) or "the model's own forward (no submodule)"
            found[(where, low)] = None
    return list(found)


def _flat_vals(vals: list[Any]) -> list[torch.Tensor]:
    """The tensors among ``vals`` (a cummax's value is a pair)."""
    out: list[torch.Tensor] = []
    for v in vals:
        out += [t for t in v if isinstance(t, torch.Tensor)] if isinstance(v, tuple) else []
        out += [v] if isinstance(v, torch.Tensor) else []
    return out


FLOOR = 1e-3  # a gradient's error scale is at least this share of the largest gradient's


def rel_error(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``max|got − ref| / max(max|ref|, floor)`` (the absolute difference when both are 0).

    ``floor`` keeps round-off in a gradient that is zero by construction (a key bias under
    softmax, say: ~1e-17 in float64) from reading as a 100 % error; ``verify`` passes
    ``FLOOR`` × the largest reference gradient, so a real error is still caught down to
    tolerance × that."""
    scale = max(ref.abs().max().item(), floor)
    diff = (got.to(ref.dtype) - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


def reference(
    model: torch.nn.Module,
    batch: Any,
    compute: torch.dtype | None = None,
    device: torch.device | None = None,
) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-device loss and gradients by the model's global parameter names (``batch``: a
    checked batch, its optional tensors passed to the model by name). ``compute``
    (bf16): the mixed-precision policy the runtime follows — a ``compute`` copy of the model
    runs on the parameters cast inside autograd, so gradients land in the (float32) masters;
    the loss is computed in float32. ``device`` (a GPU): run there, the model moved there and
    back, the gradients returned on the CPU."""
    if device is not None and device.type != "cpu":
        home = next(model.parameters()).device
        try:
            moved = {k: t.to(device) for k, t in batch_fields(batch).items()}
            value, grads = reference(model.to(device), moved, compute)
        finally:
            model.to(home)
        return value, {f: g.cpu() for f, g in grads.items()}
    fields = batch_fields(batch)
    input_ids, labels = fields.pop("input_ids"), fields.pop("labels")
    model.zero_grad(set_to_none=True)
    if compute is None:
        logits = model_logits(model, input_ids, labels, fields)
    else:
        low = copy.deepcopy(model).to(compute)
        cast = {f: p.to(compute) for f, p in model.named_parameters()}
        logits = model_logits(low, input_ids, labels, fields, params=cast).float()
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )
    loss.backward()
    grads = {
        f: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for f, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def gather(dumps: list[dict[str, Any]]) -> dict[str, list[torch.Tensor]]:
    """Every rank's gradient shards → candidate global gradients: one per whole copy (each
    data-parallel replica, each pipeline rank holding a tied weight), tp slices put together."""
    out: dict[str, list[torch.Tensor]] = {}
    pieces: dict[tuple, dict[int, tuple[Shard, torch.Tensor]]] = {}
    for d in dumps:
        c = d.get("coords", {})
        for fqn, grad in d["grads"].items():
            shard = Shard(**{**d["shards"][fqn], "shape": tuple(d["shards"][fqn]["shape"])})
            if grad is None:
                grad = torch.zeros(shard.local(torch.empty(shard.shape, device="meta")).shape)
            if shard.dim is None:
                out.setdefault(fqn, []).append(grad)
            else:
                pieces.setdefault((fqn, c.get("dp"), c.get("pp")), {})[shard.index] = (shard, grad)
    for (fqn, *_), parts in pieces.items():
        shard = parts[0][0]
        dim = shard.dim
        assert dim is not None  # only tp-split shards have pieces
        if sorted(parts) != list(range(shard.parts)):
            raise AutopartError(
                f"gradient of {fqn}: tp slices {sorted(parts)} of {shard.parts} arrived"
            )
        blocks = [
            [g.chunk(shard.strided, dim)[j] for _, (_, g) in sorted(parts.items())]
            for j in range(shard.strided)
        ]
        out.setdefault(fqn, []).append(torch.cat([torch.cat(b, dim) for b in blocks], dim))
    return out


@dataclass(frozen=True, init=False)
class Check:
    """One parity check: a model SPEC (or factory) and the ``Plan`` to run it on.

    ``Check(spec, plan)``, or ``Check(spec, pp=2, schedule="seq1f1b", seq_chunks=2)``: the mesh
    sizes ``dp``/``pp``/``tp`` and ``Plan``'s other fields by keyword, as ``parallelize`` takes
    them. The plan is built (and so checked) here: a bad plan is refused on construction.
    """

    spec: str | Factory
    plan: Plan

    def __init__(self, spec: str | Factory, plan: Plan | None = None, **fields: Any) -> None:
        if plan is None:
            plan = Plan.of(**fields)
        elif fields:
            raise AutopartError(f"Check({spec!r}): give a Plan or plan keywords, not both")
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "plan", plan)

    def __str__(self) -> str:
        """The plan in ``--plans`` syntax, e.g. ``pp=2,seq1f1b,k=2,m=4``."""
        plan = self.plan
        parts = [f"{d}={getattr(plan, d)}" for d in ("dp", "tp", "pp") if getattr(plan, d) > 1]
        parts.append(plan.schedule)
        short = {"microbatches": "m", "virtual_stages": "v", "seq_chunks": "k"}
        parts += [f"{s}={getattr(plan, k)}" for k, s in short.items() if getattr(plan, k) > 1]
        if plan.seq_split != "balanced":
            parts.append(plan.seq_split)
        if plan.sequence_parallel:
            parts.append("sp")
        if plan.max_stage_memory_gb is not None:
            parts.append(f"mem={plan.max_stage_memory_gb:g}")
        if plan.recompute != "none":
            parts.append(f"recompute={plan.recompute}")
        if plan.attention != "sdpa":
            parts.append(f"attention={plan.attention}")
        return ",".join(parts)


_PLAN_WORDS = {
    "dp": "dp",
    "tp": "tp",
    "pp": "pp",
    "m": "microbatches",
    "v": "virtual_stages",
    "k": "seq_chunks",
    "mem": "max_stage_memory_gb",
}
PLANS_HELP = (
    "plans separated by ';', each a comma-separated list of dp=N, tp=N, pp=N, m=N "
    "(micro-batches), v=N (virtual stages), k=N (sequence chunks), mem=GIB, a schedule "
    "name, sp (sequence parallel), uniform, balanced or measured (chunk split), "
    "recompute=selective|full, "
    "attention=flex"
)


def parse_plans(text: str, spec: str | Factory, base: dict[str, Any] | None = None) -> list[Check]:
    """``"tp=2; pp=2,1f1b,m=4"`` → one ``Check`` per plan (unset fields from ``base``)."""
    checks = []
    for plan in (p.strip() for p in text.split(";")):
        if not plan:
            continue
        fields: dict[str, Any] = dict(base or {})
        for word in (w.strip() for w in plan.split(",")):
            key, eq, value = word.partition("=")
            if eq and key in _PLAN_WORDS:
                try:
                    fields[_PLAN_WORDS[key]] = float(value) if key == "mem" else int(value)
                except ValueError:
                    raise AutopartError(
                        f"plan {plan!r}: {word!r} needs a number", hint=PLANS_HELP
                    ) from None
            elif key in ("recompute", "attention") and eq:
                fields[key] = value
            elif word in SCHEDULES:
                fields["schedule"] = word
            elif word == "sp":
                fields["sequence_parallel"] = True
            elif word in SPLITS:
                fields["seq_split"] = word
            else:
                raise AutopartError(f"plan {plan!r}: cannot read {word!r}", hint=PLANS_HELP)
        try:
            checks.append(Check(spec, **fields))
        except AutopartError as exc:  # name the plan of several
            raise AutopartError(f"plan {plan!r}: {exc.message}", hint=exc.hint) from None
    if not checks:
        raise AutopartError(f"no plan in {text!r}", hint=PLANS_HELP)
    return checks


@dataclass
class _Model:
    """One model of a batch of checks: built, referenced and captured once for all its plans."""

    batch: Any  # a checked batch (capture.check_batch): a pair, or a dict by name
    ref_loss: float
    ref_grads: dict[str, torch.Tensor]
    captured: Any
    islands: list[str] = field(default_factory=list)
    lowest: torch.dtype = torch.float64  # the lowest precision it computes in (dtype or island)
    tolerance: float | None = None  # mixed precision: BF16_MARGIN × the model's own bf16 error
    dropout: list[str] = field(default_factory=list)  # "module (p=…)": active in the capture


def _prepare(spec: str | Factory, dtype: str, device: str = "cpu") -> _Model:
    """Build, reference and capture one model. The reference runs on the ranks' kind of device
    (a GPU's kernels round float32 parts of a model, such as Llama's rotary tables, otherwise
    than the CPU's: about 3e-7 apart, which is not the plan's doing); the capture on the CPU."""
    model, batch = build(spec)
    mixed = DTYPES[dtype] in LOW_PRECISION  # float32 masters, low-precision compute
    model = model.to(torch.float32 if mixed else DTYPES[dtype])
    on = torch.device(device) if device.startswith("cuda") else torch.device("cpu")
    try:
        ref_loss, ref_grads = reference(model, batch, DTYPES[dtype] if mixed else None, on)
    except AutopartError:  # autopart's own refusal of the model (a required argument)
        raise
    except (RuntimeError, NotImplementedError, TypeError) as exc:  # a kernel without this dtype
        other = "float32" if dtype == "float64" else "float64"
        first = first_line(exc)
        raise AutopartError(
            f"the model does not run in {dtype} on one device, so there is no reference: {first}",
            hint=f"verify in {other} (--dtype {other}, tolerance "
            f"{TOLERANCE[DTYPES[other]]:.0e}); some kernels (e.g. grouped matmuls of mixtures "
            "of experts) have no float64 version, and need widths whose rows are multiples of "
            "16 bytes in float32 (an expert width of 37 is not: then change the config)",
        ) from exc
    except Exception as exc:  # noqa: BLE001 - the model itself fails on its example batch
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        shapes = ", ".join(f"{k} {tuple(t.shape)}" for k, t in batch_fields(batch).items())
        raise AutopartError(
            f"the model fails on one device with its example batch ({shapes}), so there is "
            f"nothing to compare with: {type(exc).__name__}: {first}",
            hint="check the batch against the model's config: token ids below its vocab_size, "
            "a sequence no longer than its position table (max_position_embeddings)",
        ) from exc
    captured = capture_mixed(model, batch, DTYPES[dtype]) if mixed else capture(model, batch)
    tolerance = BF16_MARGIN * own_error(model, batch, ref_loss, ref_grads, on) if mixed else None
    found = island_dtypes(captured.graph, captured.dtype)
    lowest = max([captured.dtype, *(d for _, d in found)], key=lambda d: torch.finfo(d).eps)
    names = [f"{module} ({_name(d)})" for module, d in found]
    return _Model(
        batch,
        ref_loss,
        ref_grads,
        captured,
        names,
        lowest,
        tolerance,
        active_dropout(captured.graph),
    )


def active_dropout(gm: Any) -> list[str]:
    """The captured graph's active dropouts, as "module (p=…)": a dropout with p > 0 in
    training mode, or attention's ``dropout_p`` > 0. The ranks draw their masks from explicit
    seeds (``dropout_rng``), so a model with one cannot match one device's run."""
    aten = torch.ops.aten
    out = []
    for n in gm.graph.nodes:
        p = None
        if n.target == aten.dropout.default and len(n.args) > 2 and n.args[2]:
            p = n.args[1]
        elif n.target == aten.scaled_dot_product_attention.default:
            p = n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)
        if isinstance(p, (int, float)) and p > 0:
            out.append(f"{n.meta.get(META_MODULE) or '<root>'} (p={p:g})")
    return out


BF16_MARGIN = 2.0


def own_error(
    model: torch.nn.Module,
    batch: Any,
    loss: float,
    grads: dict[str, torch.Tensor],
    device: torch.device | None = None,
) -> float:
    """How far the one-device mixed-precision run (``loss``, ``grads``) is from the same model
    in float32, by the verifier's metric: the rounding the precision itself brings. A plan
    passes if it moves the result by at most ``BF16_MARGIN`` times that (docs/precision.md)."""
    loss32, grads32 = reference(model, batch, device=device)
    largest = _largest(grads32)
    worst = max(rel_error(grads[f], g, FLOOR * largest) for f, g in grads32.items())
    return max(worst, abs(loss - loss32) / abs(loss32))


def _largest(grads: dict[str, torch.Tensor]) -> float:
    """The largest gradient entry: the scale of the error floor (``FLOOR``) of every tensor."""
    return max((g.abs().max().item() for g in grads.values() if g.numel()), default=0.0)


def verify_many(
    checks: Mapping[str, Check] | Sequence[Check],
    *,
    dtype: str = "float64",
    timeout_s: float = 300.0,
    workdir: str | Path | None = None,
    nnodes: int = 1,
    compile: bool = False,
    via: str = "torchrun",
    on_result: Callable[[str, Report | AutopartError], None] | None = None,
    device: str = "cpu",
) -> dict[str, Report | AutopartError]:
    """Check many plans (and models) against one device; name → ``Report``, or the
    ``AutopartError`` that stopped that check (a refused plan, a failing rank).

    Each model is built, run on one device and captured once for all of its checks.
    ``via="torchrun"`` saves every program and runs all checks of one world size in one
    torchrun launch, each rank loading program after program (the path of ``autopart run``);
    ``via="fork"`` forks each check's ranks from this process with the program in memory
    (nothing saved or loaded; no ``nnodes`` or ``compile``). ``on_result`` hears each outcome
    as it comes. ``device`` is where the ranks compute ("cuda": each on ``cuda:LOCAL_RANK``
    with NCCL, or all on one GPU over gloo with host staging when they outnumber the GPUs);
    the reference runs on the same kind of device (GPU 0), the capture on the CPU.
    """
    if dtype not in DTYPES:
        raise AutopartError(
            f"unknown dtype {dtype!r}",
            hint="use float64, float32 or bfloat16 (bf16 compute, float32 masters)",
        )
    if via not in ("torchrun", "fork"):
        raise AutopartError(f"unknown via={via!r}", hint="use 'torchrun' or 'fork'")
    if via == "fork" and (nnodes > 1 or compile or device.startswith("cuda")):
        raise AutopartError(
            "forked ranks run one node, uncompiled, on the CPU",
            hint="use via='torchrun' for nnodes > 1, compile=True or CUDA (a process that "
            "has used CUDA cannot fork ranks that use it)",
        )
    named = dict(checks) if isinstance(checks, Mapping) else _names(checks)
    results: dict[str, Report | AutopartError] = {}

    def done(name: str, result: Report | AutopartError) -> None:
        results[name] = result
        if on_result is not None:
            on_result(name, result)

    mixed = "bf16" if DTYPES[dtype] == torch.bfloat16 else None  # the precision policy
    models: dict[Any, _Model | AutopartError] = {}
    ready: dict[str, tuple[Any, _Model, float]] = {}  # name → (program, model, seconds so far)
    for name, check in named.items():
        start = time.perf_counter()
        if check.spec not in models:
            try:
                models[check.spec] = _prepare(check.spec, dtype, device)
            except AutopartError as exc:
                models[check.spec] = exc
        model = models[check.spec]
        if isinstance(model, AutopartError):
            done(name, model)
            continue
        try:
            program = parallelize(model.captured, None, plan=replace(check.plan, precision=mixed))
            program.plan.check_batch(batch_fields(model.batch)["input_ids"].shape[0])
        except AutopartError as exc:
            done(name, exc)
            continue
        ready[name] = (program, model, time.perf_counter() - start)
    with tempfile.TemporaryDirectory(prefix="autopart-verify-", dir=workdir) as tmp:
        root = Path(tmp)
        folders = {name: root / f"check{i:03d}" for i, name in enumerate(ready)}
        if via == "fork":
            for name, (program, model, seconds) in ready.items():
                start = time.perf_counter()
                try:
                    fork_ranks(
                        program,
                        model.batch,
                        folders[name] / "dump",
                        timeout_s=timeout_s,
                        device=device,
                    )
                except AutopartError as exc:
                    done(name, exc)
                    continue
                seconds += time.perf_counter() - start
                done(name, _compare(folders[name] / "dump", program, model, dtype, seconds, ""))
        else:
            by_size: dict[int, list[str]] = {}
            for name, (program, model, _) in ready.items():
                program.save(folders[name] / "program")
                torch.save(batch_fields(model.batch), folders[name] / "batch.pt")
                by_size.setdefault(program.mesh.size, []).append(name)
            for size, names in by_size.items():
                _launch_checks(
                    size, names, folders, ready, dtype, timeout_s, nnodes, compile, done, device
                )
    return {name: results[name] for name in named}


def _names(checks: Sequence[Check]) -> dict[str, Check]:
    """Each check by its plan (``pp=2,1f1b,m=4``), after its model when there are several."""
    several = len({c.spec for c in checks}) > 1
    named: dict[str, Check] = {}
    for c in checks:
        name = f"{c.spec}: {c}" if several else str(c)
        named[name if name not in named else f"{name} (#{len(named) + 1})"] = c
    return named


def _launch_checks(
    size: int,
    names: list[str],
    folders: dict[str, Path],
    ready: dict,
    dtype: str,
    timeout_s: float,
    nnodes: int,
    compile: bool,
    done: Callable,
    device: str = "cpu",
) -> None:
    """All checks of one world size in one torchrun launch; when a check fails, the ranks
    stop, that check is reported failed, and the checks after it go on in a new launch."""
    todo = list(names)
    while todo:
        start = time.perf_counter()
        manifest = folders[todo[0]] / "checks.json"
        manifest.write_text(
            json.dumps(
                {
                    "timeout": timeout_s,
                    "compile": compile,
                    "device": device,
                    "checks": [
                        {
                            "name": n,
                            "program": str(folders[n] / "program"),
                            "batch": str(folders[n] / "batch.pt"),
                            "dump": str(folders[n] / "dump"),
                            # the namespaces this caller trusted when compiling it
                            "library_ops": list(ready[n][0].plan.library_ops),
                        }
                        for n in todo
                    ],
                }
            )
        )
        error: AutopartError | None = None
        output = ""
        try:
            output = launch(
                size,
                ["-m", "autopart.parity.checks", str(manifest)],
                timeout_s=timeout_s * len(todo),
                nnodes=nnodes,
            )
        except AutopartError as exc:
            error = exc
        share = (time.perf_counter() - start) / len(todo)
        while todo and all(
            (folders[todo[0]] / "dump" / f"rank{r:05d}.pt").exists() for r in range(size)
        ):
            name = todo.pop(0)
            program, model, seconds = ready[name]
            done(
                name,
                _compare(folders[name] / "dump", program, model, dtype, seconds + share, output),
            )
        if error is not None and todo:
            done(todo.pop(0), error)
        elif error is not None:
            raise error  # every check finished, then the launch failed: say so
        elif todo:
            raise AutopartError(f"the ranks ended without checking {todo[0]}")


def _compare(
    dump: Path, program: Any, model: _Model, dtype: str, seconds: float, output: str
) -> Report | AutopartError:
    """The report of one check from its ranks' dumps (or why they cannot be compared)."""
    try:
        return _report(dump, program, model, dtype, seconds, output)
    except AutopartError as exc:  # that check's result; the others go on
        return exc


def _report(
    dump: Path, program: Any, model: _Model, dtype: str, seconds: float, output: str
) -> Report:
    dumps = [
        torch.load(dump / f"rank{r:05d}.pt", weights_only=True) for r in range(program.mesh.size)
    ]
    losses = [float(d["loss"]) for d in dumps]
    loss_error = max(abs(v - model.ref_loss) / abs(model.ref_loss) for v in losses)
    errors: dict[str, float] = {}
    largest = _largest(model.ref_grads)
    # a gradient within round-off of zero (64 ulps of the largest) is zero by construction;
    # bf16's round-off is too coarse to tell (64 ulps = half the largest gradient): none named
    cutoff = 64 * torch.finfo(model.lowest).eps
    zero = sorted(
        f
        for f, g in model.ref_grads.items()
        if cutoff < FLOOR and g.numel() and largest > 0 and g.abs().max().item() <= cutoff * largest
    )
    for fqn, copies in gather(dumps).items():
        if fqn not in model.ref_grads:
            raise AutopartError(f"rank gradients name {fqn!r}, which the model does not have")
        ref = model.ref_grads[fqn]
        errors[fqn] = max(rel_error(g, ref, FLOOR * largest) for g in copies)
    missing = set(model.ref_grads) - set(errors)
    if missing:
        raise AutopartError(f"no rank reported a gradient for {sorted(missing)[:3]}")
    worst = max(errors, key=errors.__getitem__)
    return Report(
        losses[0],
        model.ref_loss,
        loss_error,
        errors[worst],
        worst,
        model.tolerance or TOLERANCE[model.lowest],
        errors,
        seconds,
        output,
        zero,
        model.islands,
        _name(model.lowest) if model.islands else "",
        [int(d.get("saved", 0)) for d in dumps],
        model.dropout,
    )


def verify(
    spec: str | Factory,
    *,
    dp: int = 1,
    pp: int = 1,
    tp: int = 1,
    schedule: str = "1f1b",
    microbatches: int = 1,
    virtual_stages: int = 1,
    seq_chunks: int = 1,
    seq_split: str = "balanced",
    sequence_parallel: bool = False,
    max_stage_memory_gb: float | None = None,
    recompute: str = "none",
    attention: str = "sdpa",
    library_ops: Sequence[str] = (),
    dtype: str = "float64",
    timeout_s: float = 300.0,
    workdir: str | Path | None = None,
    nnodes: int = 1,
    compile: bool = False,
    via: str = "torchrun",
    device: str = "cpu",
) -> Report:
    """Run one step of the plan on real ranks and compare with one device (see module doc);
    raises the ``AutopartError`` of a refused plan or a failing rank. The plan keywords are
    ``parallelize``'s; the others ``verify_many``'s."""
    check = Check(
        spec,
        dp=dp,
        pp=pp,
        tp=tp,
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        seq_chunks=seq_chunks,
        seq_split=seq_split,
        sequence_parallel=sequence_parallel,
        max_stage_memory_gb=max_stage_memory_gb,
        recompute=recompute,
        attention=attention,
        library_ops=tuple(library_ops),
    )
    (result,) = verify_many(
        [check],
        dtype=dtype,
        timeout_s=timeout_s,
        workdir=workdir,
        nnodes=nnodes,
        compile=compile,
        via=via,
        device=device,
    ).values()
    if isinstance(result, AutopartError):
        raise result
    return result
