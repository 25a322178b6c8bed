"""Lowering: a ``Captured`` graph and a ``Plan`` become a ``Program``, one ``RankProgram`` per
rank. ``pass_runner`` applies the passes (``autopart.passes``); ``compile`` is the
``compile_program`` steps around them (stage split, shards, schedules, the dry run); ``chunks``
reads a captured model's Seq1F1B chunk costs off its graph.

Nothing below this layer imports it (the program format's types, ``PassRecord`` included,
live in ``autopart/program/``), so a rank loading a saved program imports no compiler."""

from autopart.lowering.compile import compile_program

__all__ = ["compile_program"]
