"""autopart: compile an unmodified GPT into one parallel program per rank.

import autopart
prog = autopart.parallelize(model, autopart.Mesh(dp=2), example_inputs=(input_ids, labels))
print(prog.rank(1))
prog.save("out/")   # torchrun --nproc-per-node 2 -m autopart.runtime.run out/
"""

from autopart.api import parallelize
from autopart.errors import AutopartError
from autopart.frontend.capture import Captured, capture
from autopart.frontend.cost import analyze
from autopart.layout import Mesh, Plan
from autopart.lowering import compile_program
from autopart.parity.verify import Report, verify
from autopart.program.format import Program, RankProgram
from autopart.schedule.chunks import sequence_chunks

__version__ = "0.1.0"
__all__ = [
    "AutopartError",
    "Captured",
    "Mesh",
    "Plan",
    "Program",
    "RankProgram",
    "Report",
    "analyze",
    "capture",
    "compile_program",
    "parallelize",
    "sequence_chunks",
    "verify",
]
