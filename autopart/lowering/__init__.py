"""Lowering: a ``Captured`` graph and a ``Plan`` become a ``Program``, one ``RankProgram`` per
rank. ``pass_runner`` applies the passes (``autopart.passes``); ``compile`` is the
``compile_program`` steps around them (stage split, shards, schedules).

``compile_program`` is imported on first use: the program format reads ``pass_runner``'s
records, and a rank loading a saved program needs no compiler."""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopart.lowering.compile import compile_program


def __getattr__(name: str) -> Any:
    if name == "compile_program":
        return import_module("autopart.lowering.compile").compile_program
    raise AttributeError(f"module 'autopart.lowering' has no attribute {name!r}")


__all__ = ["compile_program"]
