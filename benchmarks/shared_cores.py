"""CPU ranks on shared cores: the speed model of processes that take turns on fewer cores than
there are of them (``autopart.planning.simulate.SpeedModel``), as this machine runs 4 gloo
ranks on 2 cores. The closed loop (``closed_loop.py``) measures it (``cpu_profile.measure``),
fits it (``cpu_profile.calibrate``) and hands it to the simulator and the planner
(``simulate(..., speed=)``, ``search(..., speed=)``); closed_loop.md says why each term is there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SharedCores:
    """A node's processes share ``cores`` cores (a CPU profile's rates are one process's alone
    on a core). While the processes computing at once outnumber the cores, each runs at
    cores / their number of its speed alone; while more than one computes, each runs
    1 + ``slowdown`` times slower again (memory bandwidth and caches shared by every core and,
    while they outnumber the cores, context switches). A waiting rank leaves its share to the
    others, which is how a pipeline's bubble speeds up the other stages on a shared CPU."""

    cores: float
    slowdown: float = 0.0

    def __post_init__(self) -> None:
        if self.cores <= 0 or self.slowdown < 0:
            raise ValueError(f"{self}: cores must be positive and the slowdown not negative")

    def crowding(self, processes: float) -> float:
        if processes <= 1:
            return 1.0
        return max(1.0, processes / self.cores) * (1 + self.slowdown)
