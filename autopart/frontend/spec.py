"""Model specs: ``path/to/file.py:make`` or ``package.module:make`` → the factory's result.

A factory is ``make() -> (model, (input_ids, labels))`` with int64 ``(batch, seq)`` tensors.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopart.errors import AutopartError
from autopart.frontend.capture import batch_fields, check_batch, is_hugging_face, label_layout

Factory = Callable[[], tuple[nn.Module, tuple[Any, Any]]]


def load_factory(spec: str) -> Factory:
    """The factory a spec names (the module is imported, the function not yet called)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise AutopartError(
            f"model spec {spec!r} has no ':function' part",
            hint="write path/to/file.py:make or package.module:make",
        )
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.exists():
            raise AutopartError(f"model file {path} does not exist")
        mod_name = f"autopart_model_{path.stem}"
        sys.path.insert(0, str(path.resolve().parent))  # let the file import its neighbours
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:  # a folder, a file not .py
            raise AutopartError(
                f"model file {path} is not a Python file",
                hint="name a .py file and its factory (examples/nanogpt.py:make)",
            )
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise AutopartError(
                f"cannot import {where!r}: {exc}",
                hint="use a file path (examples/nanogpt.py:make) or an importable module",
            ) from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise AutopartError(f"{where} has no function {name!r}")
    return factory


def build(spec: str | Factory) -> tuple[nn.Module, Any]:
    """Call the factory and check what it returns."""
    factory = load_factory(spec) if isinstance(spec, str) else spec
    out = factory()
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module)):
        raise AutopartError(
            f"{spec} must return (model, (input_ids, labels)), got {type(out).__name__}"
        )
    model, batch = out
    return model, _targets(model, check_batch(batch))


def _targets(model: nn.Module, batch: Any) -> Any:
    """The batch with its labels as the targets of each position (``labels[:, t]`` the target
    of ``input_ids[:, t]``, as autopart's factories give them). A Hugging Face model's labels
    given as HF takes them, ``labels = input_ids`` (its own tests' habit), are shifted here:
    ``verify`` refused every plan of such a factory inside the ranks ("labels equal
    input_ids"), after the reference had taken them for targets. Exact: HF's loss pairs the
    logits at t with ``labels[:, t + 1]``, which is what the shifted labels pair."""
    fields = batch_fields(batch)
    ids, labels = fields["input_ids"], fields["labels"]
    if not is_hugging_face(model) or label_layout(ids, labels) != "unshifted":
        return batch
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    return {**fields, "labels": shifted} if isinstance(batch, dict) else (ids, shifted)
