"""autopart: compile an unmodified GPT into one parallel program per rank.

import autopart
prog = autopart.parallelize(model, autopart.Mesh(dp=2), example_inputs=(input_ids, labels))
print(prog.rank(1))
prog.save("out/")   # torchrun --nproc-per-node 2 -m autopart.runtime.run out/
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

import autopart.process  # noqa: F401 - first: it records this process's parent before torch
from autopart.errors import AutopartError

# name → the module that defines it; imported on first use (PEP 562), so a rank that only
# runs a saved program never imports the compiler or the verifier
_LAZY = {
    "parallelize": ".api",
    "Captured": ".frontend.capture",
    "capture": ".frontend.capture",
    "analyze": ".frontend.cost",
    "Mesh": ".layout",
    "Plan": ".layout",
    "compile_program": ".lowering",
    "Report": ".parity.verify",
    "verify": ".parity.verify",
    "verify_many": ".parity.verify",
    "Check": ".parity.verify",
    "Program": ".program.format",
    "RankProgram": ".program.format",
    "sequence_chunks": ".lowering.chunks",
}
_MODULES = {"checkpoint": ".runtime.checkpoint"}  # ``from autopart import checkpoint``

if TYPE_CHECKING:
    from autopart.api import parallelize
    from autopart.frontend.capture import Captured, capture
    from autopart.frontend.cost import analyze
    from autopart.layout import Mesh, Plan
    from autopart.lowering import compile_program
    from autopart.lowering.chunks import sequence_chunks
    from autopart.parity.verify import Check, Report, verify, verify_many
    from autopart.program.format import Program, RankProgram
    from autopart.runtime import checkpoint


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    if name in _MODULES:
        return import_module(_MODULES[name], __name__)
    raise AttributeError(f"module 'autopart' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, *_MODULES])


__version__ = "0.1.0"
__all__ = [
    "AutopartError",
    "Captured",
    "Check",
    "Mesh",
    "Plan",
    "Program",
    "RankProgram",
    "Report",
    "analyze",
    "capture",
    "checkpoint",
    "compile_program",
    "parallelize",
    "sequence_chunks",
    "verify",
    "verify_many",
]
