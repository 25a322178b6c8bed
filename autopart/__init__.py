"""autopart: compile an unmodified GPT into one parallel program per rank.

import autopart
prog = autopart.parallelize(model, autopart.Mesh(dp=2), example_inputs=(input_ids, labels))
print(prog.rank(1))
prog.save("out/")   # torchrun --nproc-per-node 2 -m autopart.run out/
"""

from autopart.api import compile_program, parallelize
from autopart.capture import Captured, capture
from autopart.chunks import sequence_chunks
from autopart.cost import analyze
from autopart.emit import Program, RankProgram
from autopart.errors import AutopartError
from autopart.plan import Mesh, Plan
from autopart.verify import Report, verify

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
