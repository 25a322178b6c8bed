"""What a saved stage graph (``stageN.pt2``) may hold, checked before torch reads it.

``torch.export.load`` unpickles constants an archive marks for pickling, reads "opaque"
constants with ``pickle.loads`` and resolves each node's call target by attribute lookup: a
crafted archive can run code while it loads, or when its graph runs. autopart writes stage
graphs with every input explicit, so its archives hold no weights, no constants, no example
inputs, no custom objects and no guard code, and call only ATen ops, autopart's own ops and a
few Python operators on sizes. ``check_pt2`` refuses any archive that holds more, reading only
the zip directory and JSON; ``check_targets`` checks the loaded graph once more.
"""

from __future__ import annotations

import json
import operator
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import fx

from autopart.errors import AutopartError

# the archive members autopart's own save writes (under one top-level folder)
_MEMBERS = {
    "archive_format",
    "archive_version",
    ".data/version",
    ".data/serialization_id",
    "byteorder",
    "models/model.json",
    "data/weights/model_weights_config.json",
    "data/constants/model_constants_config.json",
    "data/sample_inputs/model.pt",
}
_EMPTY = {"data/weights/model_weights_config.json", "data/constants/model_constants_config.json"}
NAMESPACES = ("torch.ops.aten.", "torch.ops.autopart.")
PYTHON_OPS = {
    f"_operator.{f}"
    for f in (
        "add",
        "sub",
        "mul",
        "floordiv",
        "truediv",
        "mod",
        "pow",
        "neg",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "getitem",
        "and_",
        "or_",
    )
}
PYTHON_OPS |= {
    f"torch.{f}"
    for f in (
        "sym_max",
        "sym_min",
        "sym_not",
        "sym_float",
        "sym_int",
        "sym_ite",
        "sym_sum",
        "sym_sqrt",
    )
}
# the Python callables those names resolve to (for the loaded graph's own check)
_PY_CALLABLES = {getattr(operator, t.split(".", 1)[1]) for t in PYTHON_OPS if t.startswith("_")}
_PY_CALLABLES |= {getattr(torch, t.split(".", 1)[1]) for t in PYTHON_OPS if t.startswith("torch")}
_TREESPEC_TYPES = {None, "builtins.tuple", "builtins.list", "builtins.dict"}


def check_pt2(path: Path) -> None:
    """Refuse ``path`` unless it is a stage graph as autopart writes it (see the module doc)."""

    def refuse(why: str) -> AutopartError:
        return AutopartError(
            f"{path} is not a stage graph autopart wrote: {why}; it was not loaded",
            hint="loading it could run code from it. Re-save the program with "
            "Program.save(), and keep program folders where only you can write",
        )

    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            tops = {i.filename.split("/", 1)[0] for i in infos}
            if len(tops) != 1:
                raise refuse(f"its members sit under {len(tops)} top-level folders")
            top = tops.pop()
            members = {i.filename.split("/", 1)[1]: i for i in infos if "/" in i.filename}
            extra = sorted(set(members) - _MEMBERS)
            if extra:
                raise refuse(
                    f"it holds {extra[0]!r}, which autopart never writes (weights, "
                    "constants or objects torch would unpickle)"
                )
            if "models/model.json" not in members:
                raise refuse("it has no models/model.json")
            sample = members.get("data/sample_inputs/model.pt")
            if sample is not None and sample.file_size:
                raise refuse("it holds example inputs, which torch would unpickle")
            for name in _EMPTY & set(members):
                if json.loads(z.read(f"{top}/{name}")) != {"config": {}}:
                    raise refuse(f"{name} lists weights or constants to load")
            model = json.loads(z.read(f"{top}/models/model.json"))
    except zipfile.BadZipFile as exc:
        raise refuse("it is not a zip archive") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise refuse("its JSON does not parse") from exc
    if not isinstance(model, dict) or not isinstance(model.get("graph_module"), dict):
        raise refuse("models/model.json has no graph")
    if model.get("guards_code"):
        raise refuse("it carries guard code")
    graph = model["graph_module"].get("graph", {})
    if graph.get("custom_obj_values"):
        raise refuse("it carries custom objects")
    for node in graph.get("nodes", []):
        target = node.get("target") if isinstance(node, dict) else None
        if not isinstance(target, str) or not allowed(target):
            raise refuse(
                f"a node calls {target!r}, which is not an ATen op, an autopart op "
                "or a Python operator on sizes"
            )
    for spec in _treespec_types(model["graph_module"].get("module_call_graph", [])):
        if spec not in _TREESPEC_TYPES:
            raise refuse(f"its call signature names the type {spec!r}")


def allowed(target: str) -> bool:
    """A serialized call target autopart's stage graphs may use."""
    return target.startswith(NAMESPACES) or target in PYTHON_OPS


def allowed_call(n: fx.Node) -> bool:
    """``n`` calls an ATen or autopart op or a Python operator on sizes (what a saved stage
    graph may call; ``compile_program`` refuses anything else before it saves one)."""
    target = n.target
    return n.op == "call_function" and (
        (isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "autopart"))
        or target in _PY_CALLABLES
    )


def check_targets(graph: fx.GraphModule, where: Path) -> None:
    """Every call in a loaded stage graph is an ATen or autopart op or a Python size op."""
    for n in graph.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if not allowed_call(n):
            target = n.target
            raise AutopartError(
                f"{where}: node {n.name} calls {target!r} ({n.op}), which a "
                "stage graph autopart wrote never does; it was not run",
                hint="re-save the program with Program.save()",
            )


def _treespec_types(calls: Any) -> list[Any]:
    """Every ``type`` named in the serialized pytree specs of the call signature."""
    out: list[Any] = []

    def walk(spec: Any) -> None:
        if isinstance(spec, dict):
            if "type" in spec:
                out.append(spec["type"])
            for child in spec.get("children_spec", []) or []:
                walk(child)
        elif isinstance(spec, list):
            for x in spec:
                walk(x)

    for entry in calls if isinstance(calls, list) else []:
        sig = (entry or {}).get("signature") or {}
        for key in ("in_spec", "out_spec"):
            text = sig.get(key)
            if isinstance(text, str):
                try:
                    walk(json.loads(text))
                except json.JSONDecodeError:
                    out.append("<unreadable spec>")
    return out
