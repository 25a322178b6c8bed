"""Typed reads of an fx node's positional arguments.

fx types every ``node.args[i]`` as ``Argument``: a union of nodes, numbers, sequences,
mappings, slices, dtypes, devices, ... and None. Which of them a position holds is fixed by the
node's op schema (``aten.softmax``'s 0 is a tensor, its 1 an int), which a type checker cannot
see. The passes read arguments through these accessors where the type matters: each names the
kind the schema gives and asserts it, so a graph that breaks the assumption fails at the read
rather than at some attribute use further on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

__all__ = ["float_arg", "int_arg", "node_arg", "optional_node_arg", "seq_arg", "whole_slice"]


def node_arg(n: fx.Node, i: int) -> fx.Node:
    """``n.args[i]``, a tensor (or other value) computed by another node of the graph."""
    a = n.args[i]
    assert isinstance(a, fx.Node), f"{n.name}: argument {i} is {type(a).__name__}, not a node"
    return a


def optional_node_arg(n: fx.Node, i: int) -> fx.Node | None:
    """``n.args[i]`` for an optional tensor (``Tensor?``): a node, or None when given as None or
    not given at all."""
    a = n.args[i] if len(n.args) > i else None
    assert a is None or isinstance(a, fx.Node), (
        f"{n.name}: argument {i} is {type(a).__name__}, not a node"
    )
    return a


def int_arg(n: fx.Node, i: int, name: str | None = None, default: int | None = None) -> int:
    """``n.args[i]``, a plain int (a dim, a count, a constant size); with ``name``, an argument
    that may come by keyword instead: ``n.kwargs[name]`` when there is no ``n.args[i]``, else
    ``default``."""
    a = n.args[i] if name is None or len(n.args) > i else n.kwargs.get(name, default)
    assert isinstance(a, int), f"{n.name}: argument {i} is {type(a).__name__}, not an int"
    return a


def float_arg(n: fx.Node, i: int, name: str | None = None, default: float | None = None) -> float:
    """``n.args[i]``, a plain number (a probability, a scale); ``name`` and ``default`` as for
    ``int_arg``."""
    a = n.args[i] if name is None or len(n.args) > i else n.kwargs.get(name, default)
    assert isinstance(a, (int, float)), (
        f"{n.name}: argument {i} is {type(a).__name__}, not a number"
    )
    return a


def seq_arg(n: fx.Node, i: int) -> Sequence[Any]:
    """``n.args[i]``, a list or tuple (a shape, dims, tensors); its items as the schema has them
    (ints, SymInts, nodes, None)."""
    a = n.args[i]
    assert isinstance(a, (list, tuple)), (
        f"{n.name}: argument {i} is {type(a).__name__}, not a sequence"
    )
    return a


def whole_slice(n: fx.Node) -> bool:
    """``n`` is ``aten.slice`` keeping every index of its dim, in order: start 0, step 1, and an
    end past the dim (``x[:, 0:MAX]``, Hugging Face's ``logits_to_keep=0``) or the dim's own
    size (``x[:, :s]`` of an ``s``-long dim); or ``aten.slice_scatter`` writing such a slice
    (``out[:, :, i] = v`` functionalized writes ``out[:]`` whole: the value written)."""
    if n.target == torch.ops.aten.slice.Tensor:
        k = 0
    elif n.target == torch.ops.aten.slice_scatter.default:
        k = 1
    else:
        return False
    args = list(n.args[k:])
    start, end, step = (args[2:] + [None, None, 1][len(args) - 2 :])[:3]
    x, dim = n.args[0], args[1] if len(args) > 1 else 0
    size = x.meta["val"].shape[dim] if isinstance(x, fx.Node) and isinstance(dim, int) else None
    past = end is None or (isinstance(end, int) and end >= 2**62)
    same = size is not None and str(end.meta["val"] if isinstance(end, fx.Node) else end) == str(
        size
    )
    return bool(start in (None, 0) and step == 1 and (past or same))
