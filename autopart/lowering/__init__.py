"""Lowering: a ``Captured`` graph and a ``Plan`` become a ``Program``, one ``RankProgram`` per
rank. ``pass_runner`` applies the passes (``autopart.passes``); ``compile`` is the
``compile_program`` steps around them (stage split, shards, schedules)."""

from autopart.lowering.compile import compile_program

__all__ = ["compile_program"]
