"""Shape propagation: recompute every node's ``meta["val"]`` (FakeTensor, symbolic b and s)
after a pass changed parameter shapes or inserted nodes. A shape constant a pass rewrote wrongly
fails here, as an ``AutopartError`` that names the node — never later as silent garbage."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch._decomp import decompositions as _decomp
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autopart.errors import AutopartError
from autopart.meta import META_INPUT, META_MODULE, META_RANGES


def _misfit(n: fx.Node, exc: Exception, hint: str | None = None) -> AutopartError:
    """The error of node ``n`` whose shapes did not fit: the node, its module, torch's line."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    kind = "IndexError" if isinstance(exc, IndexError) else type(exc).__name__
    op = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", n.target)
    if isinstance(n.target, torch._ops.OpOverload):
        op = f"{n.target.namespace}.{n.target._schema.name.partition('::')[2]}"
    return AutopartError(
        f"shapes do not fit at node %{n.name} = {op} (module "
        f"{n.meta.get(META_MODULE) or 'the model itself'}): {kind}: {first}",
        hint=hint,
    )


class _Prop(FakeTensorProp):
    def run_node(self, n: fx.Node):
        try:
            return super().run_node(n)
        except AutopartError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the node whatever went wrong
            if _strided_view(n, exc):
                # export wrote ``reshape`` as ``view`` where the traced input's strides allowed
                # it (an attention kernel's output laid out (b, s, h, d)); a pass that rebuilt
                # the input may give other strides: the reshape it was, the same values
                n.target = torch.ops.aten.reshape.default
                return self.run_node(n)
            raise _misfit(
                n,
                exc,
                "a pass rewrote a shape it could not prove; please report this with the model",
            ) from exc

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        # torch 2.11's C++ matmul reads plain sizes, and its fake ``aten.size`` casts each to
        # int: either pins a symbolic batch or sequence to its example value (so does 2.13's
        # fake ``polar``). These compute the same values with the sizes kept symbolic.
        if target in _SYMBOLIC:
            return _SYMBOLIC[target](*args, **kwargs)
        return super().call_function(target, args, kwargs)


def _strided_view(n: fx.Node, exc: Exception) -> bool:
    """``n`` is an ``aten.view`` whose sizes fit but whose input's strides do not allow it."""
    return n.target == torch.ops.aten.view.default and "Cannot view a tensor with shape" in str(exc)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    out = _decomp.matmul(x, w.t())
    return out if b is None else out + b


def _pad(x: torch.Tensor, pad: list) -> torch.Tensor:
    """``aten.pad``'s shape: a pad by an amount computed from the length (a Mamba-2 scan's
    padding to a multiple of its chunk) fails torch's fake kernel."""
    shape = list(x.shape)
    for i in range(len(pad) // 2):
        shape[-1 - i] = shape[-1 - i] + pad[2 * i] + pad[2 * i + 1]
    return x.new_empty(shape)


def _fft(kind: str) -> Callable[..., torch.Tensor]:
    """The shape and dtype of a one-dim FFT (``fft_rfft``, ``fft_irfft``, ``fft_fft``,
    ``fft_ifft``) of length ``n`` along ``dim``: torch's fake kernels want a concrete ``n``,
    and a causal FFT convolution (Hyena, S4, MEGA) pads to ``2·s``."""

    def shape(x: torch.Tensor, n: Any = None, dim: int = -1, norm: str | None = None) -> Any:
        sizes, d = list(x.shape), dim % x.dim()
        if kind == "irfft":
            sizes[d] = 2 * (sizes[d] - 1) if n is None else n
            return x.new_empty(sizes, dtype=x.dtype.to_real())
        length = sizes[d] if n is None else n
        sizes[d] = length // 2 + 1 if kind == "rfft" else length
        dtype = x.dtype if x.dtype.is_complex else x.dtype.to_complex()
        return x.new_empty(sizes, dtype=dtype)

    return shape


_SYMBOLIC: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.size.default: lambda x: tuple(x.shape),
    torch.ops.aten.matmul.default: lambda a, b: _decomp.matmul(a, b),
    torch.ops.aten.linear.default: _linear,
    # Llama 4's complex rotary: torch 2.13's fake ``polar`` (and ``complex``) pins the sequence
    # to its example; only the shape and dtype are needed here
    torch.ops.aten.polar.default: lambda r, a: r.new_empty(
        torch.broadcast_shapes(r.shape, a.shape),
        dtype=torch.complex128 if r.dtype == torch.float64 else torch.complex64,
    ),
    torch.ops.aten.pad.default: lambda x, pad, mode="constant", value=None: _pad(x, pad),
    torch.ops.aten.fft_rfft.default: _fft("rfft"),
    torch.ops.aten.fft_irfft.default: _fft("irfft"),
    torch.ops.aten.fft_fft.default: _fft("fft"),
    torch.ops.aten.fft_ifft.default: _fft("ifft"),
}


def fake_mode(vals: list[Any]) -> FakeTensorMode:
    """The fake mode of a graph's values (export's), which they must have."""
    mode = detect_fake_mode(vals)
    assert mode is not None, "no fake tensor mode among the values"
    return mode


def fake_like(val: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A FakeTensor of ``shape`` in the same fake mode (and dtype) as ``val``."""
    with fake_mode([val]):
        return torch.empty(shape, dtype=val.dtype, device=val.device)


def propagate(gm: fx.GraphModule) -> fx.GraphModule:
    """Re-run fake propagation from the placeholders' ``meta["val"]``; updates every node."""
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(inputs)
    # floating inputs as autograd sees them in training: torch 2.11's matmul, asked to fold a
    # batched input against a weight that needs no gradient, reads a symbolic numel and fails
    inputs = [
        x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for x in inputs
    ]
    _Prop(gm, mode).propagate_dont_convert_inputs(*inputs)
    return gm


class PastTable(IndexError):
    """A lookup of indices computed from the sizes alone past its table's rows."""


def holds_at(gm: fx.GraphModule, batch: int, seq: int) -> str | None:
    """Whether the captured model graph ``gm`` fits a batch of ``batch`` sequences of ``seq``
    tokens: fake propagation with those concrete sizes (no memory, no compute). None if it
    does, else why not (the node, its module and torch's message)."""
    failed = _misfit_at(gm, batch, seq)
    return None if failed is None else failed.message.removeprefix("shapes do not fit at ")


def _misfit_at(gm: fx.GraphModule, batch: int, seq: int) -> AutopartError | None:
    """``holds_at``'s error itself (its ``__cause__`` is torch's, or ``PastTable``)."""
    mode = FakeTensorMode()
    inputs = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta["val"]
        if n.meta[META_INPUT].kind == "data":  # a batch tensor: (batch, seq)
            shape = (batch, seq, *(int(d) for d in val.shape[2:]))
        else:  # parameters, buffers, lifted constants: their own sizes
            shape = tuple(int(d) for d in val.shape)
        with mode:
            x = torch.empty(shape, dtype=val.dtype)
        inputs.append(x.requires_grad_() if x.is_floating_point() else x)
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs each failing kernel
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with mode:
            _Fits(gm).run(*inputs)
    except AutopartError as exc:
        return exc
    finally:
        quiet.setLevel(level)
    return None


# the most elements of an integer value computed from sizes alone that ``_Fits`` computes for
# real (position ids of a million tokens; not a (s, s) mask)
KNOWN_NUMEL = 1 << 22


def _lookups(n: fx.Node) -> list[tuple[Any, Any, int]]:
    """The (table, index, dim) of each lookup ``n`` makes: ``embedding``, ``index_select``,
    ``gather``, ``index``."""
    a: Any = n.args
    if n.op != "call_function":
        return []
    if n.target == torch.ops.aten.embedding.default:
        return [(a[0], a[1], 0)]
    if n.target in (torch.ops.aten.index_select.default, torch.ops.aten.gather.default):
        return [(a[0], a[2], int(a[1]))]
    if n.target == torch.ops.aten.index.Tensor:
        return [(a[0], idx, d) for d, idx in enumerate(a[1]) if idx is not None]
    return []


class _Fits(fx.Interpreter):
    """``_Prop``'s run on fake tensors (under the caller's fake mode), leaving every node's
    ``meta`` as it was. Integer values computed from the sizes alone (position ids:
    ``arange(s)`` and what is done to it) are computed for real as well, so that a lookup of
    them in a table (``embedding``, ``index``, ``index_select``, ``gather``) past its rows fails
    here, as it would in the ranks: a learned position table's length is a limit that fake
    tensors alone do not see."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.known: dict[fx.Node, torch.Tensor] = {}
        # only what an index of a lookup is computed from is computed for real
        self.feeds_index: set[fx.Node] = set()
        stack = [idx for n in gm.graph.nodes for _, idx, _ in _lookups(n)]
        while stack:
            x = stack.pop()
            if isinstance(x, fx.Node) and x not in self.feeds_index:
                self.feeds_index.add(x)
                stack.extend(x.all_input_nodes)

    def run_node(self, n: fx.Node) -> Any:
        try:
            out = super().run_node(n)
            if n.op == "call_function":
                self._check_lookup(n)
                self._compute(n, out)
            return out
        except Exception as exc:  # noqa: BLE001 - name the node whatever went wrong
            raise _misfit(n, exc) from exc

    def _compute(self, n: fx.Node, out: Any) -> None:
        """Compute ``n`` for real when it is a small integer tensor and its tensor inputs are."""
        if (
            n not in self.feeds_index
            or not isinstance(out, torch.Tensor)
            or out.dtype.is_floating_point
            or out.dtype.is_complex
            or out.numel() > KNOWN_NUMEL
        ):
            return
        inputs_known = True

        def real(a: Any) -> Any:
            nonlocal inputs_known
            if isinstance(a, fx.Node):
                if a in self.known:
                    return self.known[a]
                v = self.env[a]
                if isinstance(v, torch.Tensor) or not isinstance(v, (int, bool, float)):
                    inputs_known = False
                return v
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        args = fx.node.map_aggregate(n.args, real)
        kwargs = fx.node.map_aggregate(n.kwargs, real)
        if not inputs_known:
            return
        with unset_fake_temporarily():
            try:
                value = n.target(*args, **kwargs)  # type: ignore[operator]
            except Exception:  # noqa: BLE001 - not computable for real: left unknown
                return
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(out.shape):
            self.known[n] = value

    def _check_lookup(self, n: fx.Node) -> None:
        """Refuse a lookup of known indices past its table's rows."""
        for table, index, dim in _lookups(n):
            if index not in self.known or not isinstance(table, fx.Node):
                continue
            idx = self.known[index]
            if idx.dtype == torch.bool or idx.numel() == 0:
                continue
            rows = self.env[table].shape[dim % self.env[table].dim()]
            with unset_fake_temporarily():
                top = int(idx.max())
            if isinstance(rows, int) and top >= rows:
                raise PastTable(
                    f"index {top} is out of range for the {rows} rows of {table.name} "
                    f"({PAST_TABLE})"
                )

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in _SYMBOLIC:
            return _SYMBOLIC[target](*args, **kwargs)
        return super().call_function(target, args, kwargs)


LONGEST = 1 << 20  # tokens: a graph that fits this long a sequence is taken to fit any
# why a longer sequence fails when the model's own table of positions is too short for it
PAST_TABLE = "a table of positions shorter than the sequence"


def longest_sequence(gm: fx.GraphModule, example: tuple[int, int]) -> tuple[int | None, str]:
    """The longest sequence (a multiple of 8, at least the example's) that the captured graph
    ``gm`` fits, and why a longer one does not; ``(None, "")`` if it fits ``LONGEST`` tokens.

    torch.export keeps the length symbolic, but a guard of the model's code may bound it (a
    loop over blocks of 256 tokens that ran once for the example: MiniMax's lightning
    attention), which export records as the range of the input's length: beyond it the graph
    may compute something else, so that bound is the limit. Export may also fix a size that
    the example's length implied without a guard (a scan's block count when the example is
    shorter than one block), and a model may slice a table of positions (a ``position_ids``
    buffer): then a longer sequence fails with a shape error. An example longer than a table
    of positions it looks up is refused: the model itself fails on it. Fake propagation at the bound
    (else ``LONGEST`` tokens) finds it (one pass, no memory); then doubling from the example,
    and a bisection over multiples of 8, find where it starts. A graph that fake tensors
    cannot follow at fixed sizes even at the example's length (data-dependent sizes) gets
    export's bound only."""
    b, s0 = example
    upper, name = _export_bound(gm)
    bound = (
        (None, "")
        if upper is None
        else (upper, f"export bounds the length of {name} to at most {upper} tokens")
    )
    top = LONGEST if upper is None else upper
    why = holds_at(gm, b, top)
    if why is None:
        return bound
    at_example = _misfit_at(gm, b, s0)
    if at_example is not None and isinstance(at_example.__cause__, PastTable):
        raise AutopartError(
            "the model does not run on its own example: "
            + at_example.message.removeprefix("shapes do not fit at "),
            hint=f"capture it with an example no longer than the model's table of positions "
            f"(the example has {s0} tokens); on one device the same call fails with torch's "
            "IndexError",
        )
    if at_example is not None:
        # fails at the example too: ops fake tensors cannot follow at fixed sizes (``.item()``
        # of a router's counts), so only export's bound is known
        return bound
    good, bad = s0, top  # fits good (the example), fails bad
    up = -(-2 * s0 // 8) * 8
    while up < bad:
        failed = holds_at(gm, b, up)
        if failed is not None:
            bad, why = up, failed
            break
        good, up = up, 2 * up
    while bad - good > 8:
        mid = (good + bad) // 16 * 8
        if mid <= good:
            break
        failed = holds_at(gm, b, mid)
        if failed is None:
            good = mid
        else:
            bad, why = mid, failed
    return good, f"at {bad} tokens, {why}"


def shortest_sequence(gm: fx.GraphModule, example: tuple[int, int]) -> tuple[int | None, str]:
    """The shortest sequence the captured graph ``gm`` fits and why a shorter one does not:
    the example's length when export fixed it (a model that adds a table of positions of
    exactly that length, ``x + self.pos``; a loop over the tokens that was not rolled up),
    where a shorter step would fail with a shape error inside every rank; ``(None, "")`` when
    the length is symbolic. (A symbolic graph may still miss some lengths, not a multiple of a
    scan's block say: ``Plan.seq_block`` says those.)"""
    b, s0 = example
    fixed = any(
        n.op == "placeholder"
        and n.meta[META_INPUT].kind == "data"
        and static_size(n.meta["val"].shape[1]) is not None
        for n in gm.graph.nodes
    )
    why = holds_at(gm, b, max(2, s0 // 2)) if fixed and s0 > 2 else None
    if why is None:
        return None, ""
    return s0, f"at {max(2, s0 // 2)} tokens, {why}"


def sequence_multiple(gm: fx.GraphModule, example: tuple[int, int]) -> tuple[int, str]:
    """The number of tokens every sequence must be a multiple of for the captured graph ``gm``
    to fit (1: any) and why another length does not: a model that cuts the sequence into
    pieces of k tokens (``x.reshape(b, s // k, k * d)``: pairs of tokens, patches) keeps its
    length symbolic in export, with no guard, and a length k does not divide failed at the
    step inside every rank. Only a graph whose sizes divide the length by a constant (a
    ``FloorDiv`` or ``Mod`` of it by k) pays fake propagations: at s0 − 1 tokens, then at
    s0 − k for each such k that divides the example's s0, smallest first; the first k that
    fits is the multiple. (A graph that fits s0 − 1, or none of them, gets 1.)"""
    b, s0 = example
    ks = sorted(k for k in _constant_divisors(gm) if 1 < k < s0 and s0 % k == 0)
    if not ks:
        return 1, ""
    why = holds_at(gm, b, s0 - 1)
    if why is None:
        return 1, ""
    for k in ks:
        if holds_at(gm, b, s0 - k) is None:
            return k, f"at {s0 - 1} tokens, {why}"
    return 1, ""


def _constant_divisors(gm: fx.GraphModule) -> set[int]:
    """Every constant k by which a size in ``gm``'s node values is floor-divided or taken
    modulo (``FloorDiv(s, k)``, ``Mod(s, k)``)."""
    from torch.utils._sympy.functions import FloorDiv, Mod

    out: set[int] = set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        sizes = val.shape if isinstance(val, torch.Tensor) else (val,)
        for size in sizes:
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is None or expr.is_number:
                continue
            for f in expr.atoms(FloorDiv, Mod):
                k = f.args[1]
                if k.is_Integer:
                    out.add(int(k))
    return out


def static_size(dim: Any) -> int | None:
    """A size's number when export fixed it (an int, or a SymInt whose expression is a
    number), else None (a symbol's)."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, torch.SymInt) and dim.node.expr.is_number:
        return int(dim.node.expr)
    return None


def _export_bound(gm: fx.GraphModule) -> tuple[int | None, str]:
    """The smallest finite upper bound export's range constraints put on a batch input's
    length (dim 1), and that input's name; ``(None, "")`` when none is bounded."""
    ranges = gm.meta.get(META_RANGES, {})
    best: tuple[int | None, str] = (None, "")
    for n in gm.graph.nodes:
        if n.op != "placeholder" or n.meta[META_INPUT].kind != "data":
            continue
        size = n.meta["val"].shape[1]  # a batch tensor: (batch, seq)
        expr = getattr(getattr(size, "node", None), "expr", None)
        vr = ranges.get(expr)
        if vr is None or not vr.upper.is_Integer:  # int_oo: no bound
            continue
        upper = int(vr.upper)
        if best[0] is None or upper < best[0]:
            best = (upper, n.name)
    return best
