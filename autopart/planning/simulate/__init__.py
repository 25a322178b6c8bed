"""Simulate a training iteration: the schedule IR, timed by a performance model of a GPU cluster.

Two layers:

- ``simulate_actions(actions_by_rank, cost_fn, comm_fn)``: an event simulator over any per-rank
  action lists (``autopart.schedule``). Each rank runs its actions in order. ``F``/``B`` take
  ``cost_fn(action)`` seconds. A ``SEND`` does not block (the runtime's ``isend``): its message
  arrives ``comm_fn(action)`` seconds later. A ``RECV`` waits for that arrival. ``DP_REDUCE``
  waits for the rank's gradient reductions, which start when each stage's last backward
  starts and run one after another on one stream; ``TIE_REDUCE`` is an all-reduce of every
  rank that has one. A speed model (``speed=``) stretches the computing of ranks that compute
  at once on a node (default ``DEDICATED``: never). Returns a ``Timeline`` (events, span,
  per-rank busy and waiting times).
- ``simulate(shape, cluster, plan)``: a GPT shape (``GPTShape``), a ``Cluster`` (hardware and
  attention kernel) and an ``autopart.Plan`` (mesh, schedule, micro-batches, recompute, ...) → per-action costs from the
  performance model (``CostModel``) → ``simulate_actions`` over the actions ``generate`` gives
  (the same generators the runtime uses) → a ``Simulation`` with iteration time, tokens/s,
  TFLOP/s per GPU, MFU, bubble fraction, memory per GPU and a time breakdown.

One pipeline (pp ranks) is simulated: every dp and tp replica runs the same program at the same
speed. docs/simulate.md states the model, its constants and what every output counts.

The package, in the order the data flows:

- ``shape.py``: ``GPTShape``, ``SHAPES``, ``shape_from_captured``, ``resolve_model``;
- ``performance.py``: the performance model, ``CostModel`` (per-action seconds and bytes);
- ``speed.py``: the speed model, ``SpeedModel`` (how ranks computing at once slow each other;
  ``DEDICATED``: not at all, every rank on a device of its own);
- ``events.py``: the event simulator, ``simulate_actions`` → ``Timeline``;
- ``iteration.py``: ``simulate``, its summary and tables.
"""

from autopart.planning.simulate.events import (
    Event,
    RankTimes,
    Timeline,
    simulate_actions,
    to_chrome_trace,
)
from autopart.planning.simulate.iteration import (
    EXACT_LIMIT,
    Simulation,
    _actions,
    breakdown_table,
    fast_lower_bound,
    print_summary,
    simulate,
    simulate_costs,
)
from autopart.planning.simulate.performance import (
    VOCAB_MULTIPLE,
    CostModel,
    UnitCost,
    stage_layers,
    stage_params,
)
from autopart.planning.simulate.shape import (
    SHAPES,
    GPTShape,
    resolve_model,
    resolve_shape,
    shape_from_captured,
)
from autopart.planning.simulate.speed import DEDICATED, Dedicated, SpeedModel

__all__ = [
    "DEDICATED",
    "EXACT_LIMIT",
    "SHAPES",
    "VOCAB_MULTIPLE",
    "CostModel",
    "Dedicated",
    "Event",
    "GPTShape",
    "RankTimes",
    "Simulation",
    "SpeedModel",
    "Timeline",
    "UnitCost",
    "_actions",
    "breakdown_table",
    "fast_lower_bound",
    "print_summary",
    "resolve_model",
    "resolve_shape",
    "shape_from_captured",
    "simulate",
    "simulate_actions",
    "simulate_costs",
    "stage_layers",
    "stage_params",
    "to_chrome_trace",
]
