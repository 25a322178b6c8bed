"""The laboratory's tests: the code the benchmarks fit and check the simulator with (this CPU's
profile and shared cores, the published runs). benchmarks/ goes on the path, as the benchmark
scripts put it there."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
