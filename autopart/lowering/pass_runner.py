"""The pass runner: applies the ordered passes to a graph, checking and recording each.

A pass that fails with anything but an ``AutopartError`` (a bug of the pass on that model)
becomes an ``AutopartError`` naming the pass, so a plan is refused, not crashed. After every
pass the graph is linted and recompiled; the runner checks that the pass returned
a ``GraphModule``, times it, and keeps the generated code so that ``Program.history`` (and
``autopart inspect --after PASS``) shows the program after each step. The graph's
``meta["autopart.passes"]`` lists the passes that made it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from torch import fx

from autopart.errors import AutopartError
from autopart.layout import Plan
from autopart.meta import META_PASSES
from autopart.program.format import PassRecord

log = logging.getLogger("autopart")
Pass = Callable[[fx.GraphModule, Plan], fx.GraphModule]


def run_passes(
    gm: fx.GraphModule, plan: Plan, passes: Sequence[Pass]
) -> tuple[fx.GraphModule, list[PassRecord]]:
    history = [PassRecord("capture", 0.0, gm.code)]
    for i, p in enumerate(passes, 1):
        name = getattr(p, "__name__", repr(p))
        start = time.perf_counter()
        try:
            out = p(gm, plan)
        except AutopartError:
            raise
        except Exception as exc:  # noqa: BLE001 - a pass's own bug on this model: say which
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise AutopartError(
                f"pass {i} ({name}) failed on this model: {type(exc).__name__}: {first}",
                hint="this is a bug in autopart, not in the model; please report it with the "
                "model and plan (the chained traceback shows where); a plan without this pass's "
                "feature may work meanwhile",
            ) from exc
        if not isinstance(out, fx.GraphModule):
            raise AutopartError(
                f"pass {i} ({name}) returned {type(out).__name__}, not a GraphModule"
            )
        out.graph.lint()
        out.recompile()
        out.meta[META_PASSES] = [*gm.meta.get(META_PASSES, []), name]
        seconds = time.perf_counter() - start
        log.info("pass %d/%d %s: %.3f s", i, len(passes), name, seconds)
        history.append(PassRecord(name, seconds, out.code))
        gm = out
    return gm, history
