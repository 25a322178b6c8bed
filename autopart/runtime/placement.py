"""Where a rank runs: its device, the process-group backend for it, and its graphs placed there.

A compiled program names no device (``autopart.graph.device_free``). At run time each rank
picks one (``pick_device``): ``--device`` / ``device=`` when given, else ``cuda:LOCAL_RANK``
when CUDA is available, else the CPU. When a node runs more ranks than it has GPUs
(``shares_gpu``), rank ``LOCAL_RANK`` takes GPU ``LOCAL_RANK mod count``. The backend follows
(``backend_for``): NCCL for CUDA ranks with a GPU each; gloo for the CPU, the dry run and ranks
sharing a GPU (NCCL refuses two ranks on one device), whose messages then go through host copies
(``runtime/staging.py``).
``place(graph, device)`` gives the graph's factory calls (``arange``, ``full``, ``zeros`` …)
that device; on the CPU they are left as they are (the default device).

The ``meta`` device is the dry run: tensors have shapes and dtypes but no data, collectives
compute shapes only, pipeline hand-overs send their headers (over gloo) and no payload. Every
rank program runs this way in the tests (``tests/test_placement.py``), each stage graph under
``device_checked``, which refuses any value a node computes on another device (a constant
pinned to the CPU, say), naming the node: a program that passes runs on any device.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import fx, nn

from autopart.errors import AutopartError
from autopart.graph import copy_graph
from autopart.meta import META_MODULE


def pick_device(requested: str | torch.device | None = None) -> torch.device:
    """The device this rank runs on (see the module docstring)."""
    if requested:
        try:
            dev = torch.device(requested)
        except RuntimeError as exc:
            raise AutopartError(
                f"unknown device {requested!r}", hint="use cpu, cuda, cuda:N or meta"
            ) from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise AutopartError(
                f"device {requested!r} asked for, but CUDA is not available here",
                hint="leave --device out to run on the CPU",
            )
        if dev.type == "cuda" and dev.index is None:
            dev = _local_gpu()
        elif dev.type == "cuda" and dev.index >= torch.cuda.device_count():
            raise AutopartError(
                f"device {requested!r} asked for, but this machine has "
                f"{torch.cuda.device_count()} GPU(s)",
                hint="use --device cuda: each rank takes the GPU of its local rank",
            )
        return dev
    if torch.cuda.is_available():
        return _local_gpu()
    return torch.device("cpu")


def _local_gpu() -> torch.device:
    """GPU ``LOCAL_RANK``, or ``LOCAL_RANK mod count`` where ranks share the node's GPUs."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def shares_gpu() -> bool:
    """More ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``) than GPUs."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()


def backend_for(device: torch.device) -> str:
    """The process-group backend of a device: NCCL for CUDA ranks with a GPU each; gloo for the
    CPU, the dry run and ranks sharing a GPU (their messages go through host copies)."""
    return "nccl" if device.type == "cuda" and not shares_gpu() else "gloo"


def _makes_tensors(target: Any) -> bool:
    """An ATen op with a ``device`` argument: a factory (it makes a tensor from nothing)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(a.name == "device" for a in schema.arguments)


def place(graph: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A copy of ``graph`` with its factory calls on ``device`` (``graph`` itself on the CPU, the
    default, where nothing changes). A
    call that already names a device keeps it: compiled programs name none, so one that does
    is a bug the dry run shows."""
    if device.type == "cpu":
        return graph
    graph = copy_graph(graph)  # the program's own graph stays device-free (it may be saved)
    for n in graph.graph.nodes:
        if n.op == "call_function" and _makes_tensors(n.target) and "device" not in n.kwargs:
            n.kwargs = {**n.kwargs, "device": device}
    graph.recompile()
    return graph


class _Checked(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, device: torch.device) -> None:
        super().__init__(gm)
        self.device = device

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op in ("call_function", "get_attr"):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type != self.device.type:
                    raise AutopartError(
                        f"node {n.name} ({n.target}) of module "
                        f"{n.meta.get(META_MODULE, '') or 'the root'} made a tensor on "
                        f"{t.device} in a program run on {self.device}: a value pinned to a "
                        "device",
                        hint="the program would fail or copy on every other device; please "
                        "report the model",
                    )
        return out


class _CheckedModule(nn.Module):
    def __init__(self, gm: fx.GraphModule, device: torch.device) -> None:
        super().__init__()
        self.gm, self.device = gm, device

    def forward(self, *args: Any) -> Any:
        return _Checked(self.gm, self.device).run(*args)


def device_checked(run: fx.GraphModule, device: torch.device) -> nn.Module:
    """``run`` (a stage graph, or its checkpointed split) with every node's values checked to
    be on ``device``; a checkpointed region's body is checked where it runs, also in backward."""
    if not any(isinstance(c, nn.Module) for c in run.children()):
        return _CheckedModule(run, device)
    for name, child in list(run.named_children()):
        body = getattr(child, "body", None)  # a checkpointed region's (runtime/recompute.py)
        if isinstance(body, fx.GraphModule):
            child.body = _CheckedModule(body, device)
        elif isinstance(child, fx.GraphModule):
            setattr(run, name, _CheckedModule(child, device))
    return run
