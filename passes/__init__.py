"""autopart's compiler passes: each ``name(gm, plan) -> gm``, one file, one invariant.

The order the compiler runs them in is ``PIPELINE`` (see ``autopart.compiler``).
"""

from autopart.passes.data_parallel import data_parallel

PIPELINE = (data_parallel,)

__all__ = ["PIPELINE", "data_parallel"]
