"""The speed model: how much slower a rank computes while other processes on its node compute
too. The event simulator (``events.py``) asks it whenever the processes computing on a node
change, and the performance model asks it for the optimizer step, which every rank runs at once.

The simulator's own model is ``DEDICATED``: every rank has a device of its own, and nothing it
shares slows it. Another model plugs in through ``simulate(..., speed=)`` and
``planner.search(..., speed=)``: ``benchmarks/shared_cores.py`` models CPU ranks that take turns
on fewer cores than there are ranks (the closed loop of ``benchmarks/closed_loop.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class SpeedModel(Protocol):
    """How contended compute slows a rank."""

    def crowding(self, processes: float) -> float:
        """How many times longer than alone each of ``processes`` processes computing at once
        on one node takes over its work: at least 1, 1 for one process alone, and never less
        for more processes. It may depend on nothing else (the simulator asks it whenever the
        processes computing on a node change, and takes a node whose full load gives 1 as never
        slowed)."""
        ...


@dataclass(frozen=True)
class Dedicated:
    """Every rank on a device of its own: computing ranks never slow each other."""

    def crowding(self, processes: float) -> float:
        return 1.0


DEDICATED = Dedicated()

__all__ = ["DEDICATED", "Dedicated", "SpeedModel"]
