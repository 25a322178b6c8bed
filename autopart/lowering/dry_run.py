"""A dry run of every stage graph before any rank starts: forward and backward once, on fake
tensors (``FakeTensorMode``: shapes, dtypes and a device, no data, no process group).

What it catches at compile time that would otherwise stop every rank at its first step: an op
without a derivative (autograd marks it ``NotImplemented`` in the forward; ``aten.copy`` was
one), a shape or dtype that does not fit, and any other error an op raises on the stage's
real input shapes. Each becomes an ``AutopartError`` naming the stage, the node and its module.

The inputs are the runtime's (``program.feeds.stage_inputs``): this rank's parameter shards
(the placeholders' local shapes), the buffers, one micro-batch of the example's rows and
length, the previous stage's outputs as its activations. Under Seq1F1B the last chunk runs, with
a K/V prefix as long as the chunks before it (so the prefixed attention and its gradient into
the prefix run too), and each causal convolution's carry as long (the graph keeps the last
window of it). Each stage's backward starts from gradients of ones. The graphs of tp rank 0 of each pipeline position
stand for all (every tp rank runs the same graph on the same shapes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from autopart.errors import AutopartError, first_line
from autopart.frontend.capture import Captured, InputRef
from autopart.graph import kv_dtypes
from autopart.layout import Coords, Plan
from autopart.meta import META_KV_SHAPES, META_MODULE
from autopart.program.feeds import chunk_feeds, example_batch, stage_inputs
from autopart.schedule.chunks import chunk_bounds

_DATA_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)
_HINT = (
    "nothing was launched; please report the model with this message (the op fails on the "
    "stage's own input shapes, so every rank would fail at its first step)"
)


def dry_run(
    stages: list[fx.GraphModule],
    inputs: list[list[InputRef]],
    captured: Captured,
    plan: Plan,
    chunk_cost: tuple[float, ...] | None,
) -> None:
    """Run every stage's forward and backward once on fake tensors; raise ``AutopartError``
    naming the stage and node of the first failure (see the module docstring)."""
    rows = max(1, captured.example_shape[0] // (plan.mesh.dp * plan.microbatches))
    seq = captured.example_shape[1]
    bounds = chunk_bounds(
        chunk_cost or (1.0, 0.0), seq, plan.seq_chunks, plan.seq_split, plan.chunk_multiple
    )
    last = len(bounds) - 1  # the last chunk: its K/V prefix (the earlier chunks') is not empty
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        device = torch.device("cpu")
        batch = example_batch(rows, seq, captured.batch_names, device)
        seed = torch.tensor(0, device=device)
        weights = [
            _weights(st, refs, captured, mode) for st, refs in zip(stages, inputs, strict=True)
        ]
        for j, (a, e) in [(last, bounds[last])]:
            acts: list[Any] = []
            for s, (st, refs) in enumerate(zip(stages, inputs, strict=True)):
                shapes = st.meta.get(META_KV_SHAPES, [])
                prefix = [  # P = a tokens before the chunk, each in its carried value's dtype
                    torch.zeros(_prefix_shape(shape, rows, a), dtype=dtype)
                    for shape, dtype in zip(shapes, kv_dtypes(st), strict=True)
                ]
                prefix = [t.detach().requires_grad_(t.is_floating_point()) for t in prefix]
                data, keys = chunk_feeds(batch, a, e)
                args = stage_inputs(
                    refs,
                    params=weights[s][0],
                    buffers=weights[s][1],
                    data=data,
                    keys=keys,
                    coords=Coords(pp=s % plan.mesh.pp, dp=0, tp=0),
                    acts=acts,
                    prefix=prefix,
                    offset=a,
                    seed=seed,
                    compute=plan.compute_dtype,
                    device=device,
                )
                runner = _Run(st, s, j)
                try:
                    with torch.enable_grad():
                        out = list(runner.run(*args))
                    runner.backward(out)
                except _DATA_DEPENDENT:
                    return  # shapes that depend on values: fake tensors cannot go on from here
                if shapes:
                    out = out[: -len(shapes)]
                acts = [
                    t.detach().requires_grad_(t.is_floating_point())
                    if isinstance(t, torch.Tensor)
                    else t
                    for t in out
                ]


def _weights(
    st: fx.GraphModule, refs: list[InputRef], captured: Captured, mode: FakeTensorMode
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The stage's parameters (local shapes: a tp shard's) and buffers, fake."""
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    placeholders = [n for n in st.graph.nodes if n.op == "placeholder"]
    for n, ref in zip(placeholders, refs, strict=True):
        val = n.meta.get("val")
        if ref.kind == "param":
            t = torch.empty(tuple(int(d) for d in val.shape), dtype=val.dtype)
            params[ref.name] = torch.nn.Parameter(t, requires_grad=t.is_floating_point())
        elif ref.kind in ("buffer", "constant"):
            src = captured.buffers[ref.name]
            buffers[ref.name] = torch.empty(tuple(src.shape), dtype=src.dtype)
    return params, buffers


def _prefix_shape(shape: list[int | str], rows: int, length: int) -> list[int]:
    """A prefix shape of ``kv_shapes`` (``"b"`` for the rows, the 0 for the prefix length: a
    K/V prefix's dim −2, a convolution's carried inputs' last dim)."""
    out = [rows if d == "b" else int(d) for d in shape]
    out[max(i for i, d in enumerate(shape) if d == 0)] = length
    return out


class _Run(fx.Interpreter):
    """Runs one stage graph, naming the node that fails, and remembers which node made each
    autograd node so that a failing backward is named too."""

    def __init__(self, gm: fx.GraphModule, stage: int, chunk: int) -> None:
        super().__init__(gm)
        self.stage, self.chunk = stage, chunk
        self.made: dict[Any, fx.Node] = {}

    def where(self, n: fx.Node) -> str:
        chunk = f", chunk {self.chunk}" if self.chunk else ""
        target = f"{_name(n.target)}, " if n.op == "call_function" else ""
        return (
            f"stage {self.stage}{chunk}: node {n.name} "
            f"({target}module {n.meta.get(META_MODULE) or '<root>'})"
        )

    def run_node(self, n: fx.Node) -> Any:
        try:
            out = super().run_node(n)
        except (AutopartError, *_DATA_DEPENDENT):
            raise
        except Exception as exc:  # noqa: BLE001 - name the node whatever went wrong
            raise AutopartError(
                f"{self.where(n)} fails on fake inputs of the stage's shapes: "
                f"{type(exc).__name__}: {first_line(exc)}",
                hint=_HINT,
            ) from exc
        for t in out if isinstance(out, (list, tuple)) else [out]:
            fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if fn is None:
                continue
            if type(fn).__name__ == "NotImplemented":
                raise AutopartError(
                    f"{self.where(n)} has no derivative ({fn.name()}): the backward would fail "
                    "inside every rank",
                    hint="capture decomposes slice assignments and known library ops into ops "
                    "with derivatives; please report this op with the model",
                )
            self.made.setdefault(fn, n)
        return out

    def backward(self, out: list[Any]) -> None:
        """Backward from gradients of ones into every floating output that needs one."""
        roots = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
        if not roots:
            return
        running: list[fx.Node] = []
        hooks = [fn.register_prehook(_mark(running, n)) for fn, n in self.made.items()]
        try:
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        except (AutopartError, *_DATA_DEPENDENT):
            raise
        except Exception as exc:  # noqa: BLE001 - name the node whose backward failed
            where = (
                self.where(running[-1]) if running else f"stage {self.stage} (node not identified)"
            )
            raise AutopartError(
                f"{where}: its backward fails on fake inputs of the stage's shapes: "
                f"{type(exc).__name__}: {first_line(exc)}",
                hint=_HINT,
            ) from exc
        finally:
            for h in hooks:
                h.remove()


def _mark(running: list[fx.Node], n: fx.Node):
    def hook(grad_outputs: Any) -> None:
        running.append(n)

    return hook


def _name(target: Any) -> str:
    return target.name() if isinstance(target, torch._ops.OpOverload) else str(target)
