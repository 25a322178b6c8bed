"""FX graph utilities shared by the layers that change or run a graph: the passes, the chunk
costs, the lowering, the runtime and the tests.

- ``copy_graph(gm)``: a copy whose nodes (and node meta dicts) a pass may change freely; every
  compile, chunk-cost analysis, runtime variant (``without_dropout``, ``logits_graph``,
  ``place``) and test works on one, never on the capture or a program's own graph.
- ``device_free(gm)``: make a stage graph name no device, so that a program runs on whichever
  device its rank picks (``runtime/placement.py``).
- ``remove_dead(gm)``: erase every node the output does not depend on, impure ones included
  (``canonicalize_attention`` and ``sequence_chunk`` drop a replaced mask's construction).
- ``computation_digest(gm)``: what a captured graph computes, as a short digest (its ops and
  their constants): a checkpoint records it and refuses another model whose parameters have
  the same names and shapes (``runtime/checkpoint.py``).
- ``kv_dtypes(gm)``: the dtype of each of a Seq1F1B stage graph's prefix and carry inputs, so
  that the runtime's empty first ones match what later chunks hand over.
- ``reaches``, ``only_user``, ``row_max_of``, ``cuts_last_column``: the node tests that
  ``canonicalize_attention`` and the runtime's FlexAttention lowering both read attention with.

Nothing here knows a pass, a plan or a rank.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from autopart.errors import AutopartError
from autopart.meta import META_INPUT, META_MODULE


def computation_digest(gm: fx.GraphModule) -> str:
    """A digest of what ``gm`` computes: every node's op, its inputs (by position) and its
    constant arguments — the head counts in views, norms' epsilons, activations, dropout
    rates — with parameters and batch tensors by name. Devices, the floating dtype and casts are
    left out (a checkpoint trained in float32 on GPUs loads into the float64 model on CPU, whose
    graph casts its float32 islands where the float32 one has nothing to cast), as are the fill
    values of the dtype's extremes (``finfo(dtype).min`` masks)."""
    index: dict[fx.Node, int] = {}

    def lit(a: Any) -> str:
        if isinstance(a, fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(map(lit, a)) + "]"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}={lit(v)}" for k, v in sorted(a.items())) + "}"
        if isinstance(a, torch.device):
            return "device"
        if isinstance(a, torch.dtype):
            return "float" if a.is_floating_point else str(a)
        if isinstance(a, float) and not -1e30 < a < 1e30:
            return "-big" if a < 0 else "big"
        if isinstance(a, (bool, int, float, str, type(None))):
            return repr(a)
        return type(a).__name__

    casts = {
        torch.ops.aten._assert_tensor_metadata.default,
        torch.ops.aten._to_copy.default,
        torch.ops.aten.to.dtype,
        torch.ops.aten.to.dtype_layout,
        torch.ops.aten.to.device,
    }
    lines = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        if n.target in casts and n.args and isinstance(n.args[0], fx.Node):
            index[n] = index[n.args[0]]  # a float64 model casts where a float32 one need not
            continue
        ref = n.meta.get(META_INPUT)
        target = (
            f"{ref.kind}:{ref.name}" if ref is not None else getattr(n.target, "__name__", n.target)
        )
        lines.append(f"{n.op} {target} {lit(n.args)} {lit(n.kwargs)}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes (and node meta dicts) a pass may change freely."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    new = fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    return new


def device_free(gm: fx.GraphModule) -> None:
    """Make ``gm`` name no device: capture bakes the capture device into factory calls
    (``arange(..., device=cpu)``) and casts (``to.device(x, cpu, dtype)``, Llama's rotary
    tables). Factory calls lose their ``device`` keyword (the runtime gives them the rank's
    device), a ``to.device`` becomes ``to.dtype`` (every tensor of a rank lives on one device),
    and metadata assertions are dropped. A device left anywhere else is refused, naming the node.
    Every ``view`` becomes ``reshape``: whether a view is possible depends on the strides a
    device's kernels give their outputs (SDPA's differ between the CPU, CUDA and meta); in a
    functional graph ``reshape`` computes the same values, copying only where a view is not
    possible."""
    aten = torch.ops.aten
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
            continue
        if n.target is aten.view.default:
            n.target = aten.reshape.default
        if isinstance(n.kwargs.get("device"), torch.device):
            n.kwargs = {k: v for k, v in n.kwargs.items() if k != "device"}
        if n.target is aten.to.device:  # (x, device, dtype, non_blocking, copy, memory_format)
            n.target = aten.to.dtype
            n.args = (n.args[0], *n.args[2:])
        flat = [*n.args, *n.kwargs.values()]
        flat = [x for a in flat for x in (a if isinstance(a, (list, tuple)) else [a])]
        if any(isinstance(a, torch.device) for a in flat):
            raise AutopartError(
                f"node {n.name} ({n.target}) of module {n.meta.get(META_MODULE, '') or 'the root'} "
                "names a device, so its program could run on that device only",
                hint="please report the model; meanwhile compute that value without a device",
            )
    gm.graph.lint()
    gm.recompile()


def kv_dtypes(gm: fx.GraphModule) -> list[torch.dtype]:
    """The dtype of each ``kv`` input of ``gm`` (K/V prefixes, carried inputs and states), by
    its index (``InputRef("kv", "i")``): each travels in the dtype of the value it carries (an
    integer running count, a float32 state in a bf16 model), and the first chunk's empty one
    must be of it too."""
    kv = {
        int(ref.name): n.meta["val"].dtype
        for n in gm.graph.nodes
        if n.op == "placeholder" and getattr(ref := n.meta.get(META_INPUT), "kind", None) == "kv"
    }
    return [kv[i] for i in sorted(kv)]


def remove_dead(gm: fx.GraphModule) -> None:
    """Erase every node the output does not depend on. fx's own pass keeps "impure" nodes, so a
    dropped mask's construction would survive behind its ``_assert_tensor_metadata`` checks."""
    live, stack = set(), [n for n in gm.graph.nodes if n.op in ("output", "placeholder")]
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    for n in reversed(list(gm.graph.nodes)):
        if n not in live:
            gm.graph.erase_node(n)


def erase_unused(g: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` if nothing uses it, then each of its inputs that is left unused, and so
    on up (call nodes only: a replaced chain, with the impure dropout fx would keep)."""
    stack, gone = [node], set()
    while stack:
        n = stack.pop()
        if n in gone or n.op != "call_function" or n.users:
            continue
        stack.extend(n.all_input_nodes)
        g.erase_node(n)
        gone.add(n)


def reaches(
    x: fx.Node, found: Callable[[fx.Node], bool], depth: int, values_only: bool = False
) -> bool:
    """Whether ``x`` or a node it is computed from, at most ``depth`` calls up, is ``found``
    (call nodes only: a placeholder ends the walk; with ``values_only``, so does a size read
    off a tensor, ``sym_size``: x is then computed from the tensor's shape, not its values)."""
    stack, seen = [(x, 0)], set()
    while stack:
        n, d = stack.pop()
        if n in seen or d > depth or n.op != "call_function":
            continue
        if values_only and n.target == torch.ops.aten.sym_size.int:
            continue
        seen.add(n)
        if found(n):
            return True
        stack.extend((a, d + 1) for a in n.all_input_nodes)
    return False


def only_user(n: fx.Node) -> fx.Node | None:
    """The one user of ``n`` besides export's metadata checks, if it has exactly one."""
    users = [u for u in n.users if u.target != torch.ops.aten._assert_tensor_metadata.default]
    return users[0] if len(users) == 1 else None


def row_max_of(m: Any, x: Any) -> bool:
    """``m`` is a row's max of ``x`` (``max(x, -1, keepdim=True)[0]`` or ``amax(x, -1, True)``),
    as subtracted before a softmax."""
    aten = torch.ops.aten
    if not isinstance(m, fx.Node):
        return False
    if m.target is operator.getitem and m.args[1] == 0:
        mx = m.args[0]
        return (
            isinstance(mx, fx.Node)
            and mx.target == aten.max.dim
            and mx.args[0] is x
            and mx.args[1] in (-1, 3)
        )
    dims: Any = m.args[1] if len(m.args) > 1 else None
    return m.target == aten.amax.default and m.args[0] is x and list(dims or ()) in ([-1], [3])


def cuts_last_column(n: fx.Node) -> bool:
    """``n`` is ``x[..., :-1]``: an ``aten.slice`` of the last dim from 0 to −1, step 1."""
    if n.target != torch.ops.aten.slice.Tensor:
        return False
    dim, start, end, step = (list(n.args[1:5]) + [None] * 4)[:4]
    return bool(dim in (-1, 3) and start in (None, 0) and end == -1 and step in (None, 1))


__all__ = [
    "copy_graph",
    "cuts_last_column",
    "device_free",
    "erase_unused",
    "only_user",
    "reaches",
    "remove_dead",
    "row_max_of",
]
