"""Calibrated simulation: a measured run's per-action costs, replayed on the schedule IR.

Data enters as the trace of a real run (``autopart run DIR --trace FILE``): every rank's actions
of the last step as Chrome trace events, each with its action's fields in ``args``
(``autopart.runtime.timeline.chrome_event``), plus an ``"autopart"`` header the runtime writes
(the format version, the plan, each rank's mesh coordinates, the step's wall time). ``measure``
reduces it to the costs the simulator needs:

- **compute**: the median duration of each ``F``, ``B`` and ``W`` per (kind, stage, chunk), over
  every micro-batch and every rank holding that stage (tp and dp ranks of a stage run in
  lockstep); a ``W`` that ran in pieces (some while a receive waited, ``p2p.Channel.filler``)
  counts as the sum of its pieces;
- **reductions**: the shortest ``TIE_REDUCE`` over the ranks (every rank waits in it until the
  last one arrives, so the shortest wait is the collective itself); for ``DP_REDUCE``, the time
  from the start of the rank's last ``B`` to the end of its wait, the shortest over the ranks of
  a pipeline rank, charged to the stage of that last ``B`` (its other stages get 0). The
  simulator starts a stage's reduction at the start of its last ``B``, so this reproduces the
  measured wait exactly; the part hidden behind earlier stages' backwards is not observable;
- **transfer**: the latency of a pipeline send, read from the trace itself: for each ``RECV``
  posted before its matching ``SEND`` began (the receiver was waiting), the time from the send's
  start to the receive's end; the median per (direction, chunk), and for a chunk whose receiver
  never waited, its direction's median (the clocks of ranks on one machine agree);
- **overhead**: the step's wall time minus the span of its actions (batch slicing, the loss
  all-reduce, the optimizer step), taken as fixed.

``predict`` then runs ``autopart.planning.simulate.simulate_actions`` over the generators' action lists
(the runtime's own schedule IR) for the same layout with another number of micro-batches or
another schedule over the same units, and adds the overhead. ``autopart simulate --measured
TRACE`` is the command line for it; ``benchmarks/calibration.py`` checks it against real runs.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopart.errors import AutopartError
from autopart.planning.simulate import Timeline, simulate_actions
from autopart.runtime.timeline import HEADER, VERSION, Block, blocks, read_json
from autopart.schedule import check_schedule, generate
from autopart.schedule.generators import traits
from autopart.schedule.ir import Action


@dataclass(frozen=True)
class Measured:
    """What a measured step cost, per action: the input of ``predict``."""

    schedule: str
    pp: int
    dp: int
    tp: int
    virtual_stages: int
    microbatches: int
    seq_chunks: int
    microbatch_size: int  # sequences in one micro-batch (0: not recorded)
    microbatch_tokens: int  # sequences × tokens of one micro-batch
    tied_pp_ranks: frozenset[int]  # pipeline ranks that hold a tied weight (TIE_REDUCE)
    step_s: float  # the measured step's wall time (the slowest rank)
    compute: dict[tuple[str, int, int], float]  # (F|B, stage, chunk) → seconds
    transfer: dict[tuple[str, int], float]  # (SEND_F|SEND_B, chunk) → seconds
    dp_reduce: dict[int, float] = field(default_factory=dict)  # stage → seconds
    tie_reduce: float = 0.0
    overhead_s: float = 0.0


def load(path: str | Path) -> Measured:
    """``measure`` the trace file of ``autopart run DIR --trace FILE``."""
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get(HEADER), dict):
        raise AutopartError(
            f"{path} has no {HEADER!r} header, so it is not the trace of an "
            "autopart run (a simulated trace or another tool's cannot calibrate)",
            hint="write one with: autopart run DIR --steps 3 --trace FILE",
        )
    return measure(data.get("traceEvents") or [], data[HEADER], str(path))


def measure(
    events: list[dict[str, Any]], header: dict[str, Any], source: str = "the trace"
) -> Measured:
    """Reduce one measured step (its events and header) to per-action costs (module docstring)."""
    if header.get("version") != VERSION:
        raise AutopartError(
            f"{source}: trace format version {header.get('version')!r}, this autopart reads "
            f"version {VERSION} only: re-measure the run",
            hint="with this autopart: autopart run DIR --steps 3 --trace FILE",
        )
    try:
        plan, coords = header["plan"], {int(r): c for r, c in header["ranks"].items()}
        step_s = float(header["step_s"])
        pp_of = {r: int(c["pp"]) for r, c in coords.items()}
        layout = {
            k: int(plan[k]) for k in ("pp", "dp", "virtual_stages", "microbatches", "seq_chunks")
        }
        layout["tp"] = int(plan.get("tp", 1))
        schedule = str(plan["schedule"])
        sizes = (int(header.get("microbatch_size", 0)), int(header.get("microbatch_tokens", 0)))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise AutopartError(
            f"{source}: malformed {HEADER!r} header ({exc!r} missing or wrong)",
            hint="re-measure with: autopart run DIR --trace FILE",
        ) from None
    bs = blocks(events)
    bare = next((b for b in bs if b.action is None), None)
    if bare is not None:
        raise AutopartError(
            f"{source}: a {bare.kind!r} event of rank {bare.rank} records no autopart action in "
            "its 'args', so its costs cannot be told apart",
            hint="re-measure the run with this autopart: autopart run DIR --steps 3 --trace FILE",
        )
    if not any(b.kind in ("F", "B") for b in bs):
        raise AutopartError(f"{source} holds no F or B actions to take costs from")
    compute: dict[tuple[str, int, int], list[float]] = {}
    dp_reduce: dict[int, list[float]] = {}
    tie: list[float] = []
    sends: dict[tuple, float] = {}
    recvs: list[tuple[tuple, float, float]] = []
    last_b: dict[int, Block] = {}  # rank → its last B
    pieces: dict[tuple[int, int, int, int], float] = {}  # W seconds per (rank, unit)
    for b in sorted(bs, key=lambda b: b.start):
        a, dur = b.action, b.dur * 1e-6
        assert a is not None  # a block without its action was refused above
        if b.rank not in pp_of:
            raise AutopartError(
                f"{source}: an event of rank {b.rank}, which the header's ranks do not list",
                hint="re-measure with: autopart run DIR --trace FILE",
            )
        if b.kind == "W":  # a unit's W may come in pieces (run while a receive waited)
            unit = (b.rank, a.stage, a.mb, a.chunk)
            pieces[unit] = pieces.get(unit, 0.0) + dur
            last_b[b.rank] = b  # the stage's gradients are final after its last B (or W)
        elif b.kind in ("F", "B"):
            compute.setdefault((b.kind, a.stage, a.chunk), []).append(dur)
            if b.kind == "B":
                last_b[b.rank] = b
        elif b.kind == "DP_REDUCE":  # reproduces the simulator's rule (module docstring)
            last = last_b.get(b.rank)
            if last is not None and last.action is not None:
                seconds = max(0.0, b.end - last.start) * 1e-6
                dp_reduce.setdefault(last.action.stage, []).append(seconds)
        elif b.kind == "TIE_REDUCE":
            tie.append(dur)
        elif b.kind in ("SEND_F", "SEND_B"):
            sends[(b.kind, b.rank, a.peer, a.stage, a.mb, a.chunk)] = b.start
        elif b.kind in ("RECV_F", "RECV_B"):
            stage = a.stage - 1 if b.kind == "RECV_F" else a.stage + 1
            kind = "SEND_" + b.kind[-1]
            recvs.append(((kind, a.peer, b.rank, stage, a.mb, a.chunk), b.start, b.end))
    for (_, stage, _, chunk), dur in pieces.items():
        compute.setdefault(("W", stage, chunk), []).append(dur)
    transfer: dict[tuple[str, int], list[float]] = {}
    for key, start, end in recvs:
        sent = sends.get(key)
        if sent is not None and start <= sent:  # the receiver waited for this message
            transfer.setdefault((key[0], key[5]), []).append((end - sent) * 1e-6)
    span = (max(b.end for b in bs) - min(b.start for b in bs)) * 1e-6
    return Measured(
        schedule=schedule,
        **layout,
        microbatch_size=sizes[0],
        microbatch_tokens=sizes[1],
        tied_pp_ranks=frozenset(pp_of[b.rank] for b in bs if b.kind == "TIE_REDUCE"),
        step_s=step_s,
        compute={k: statistics.median(v) for k, v in compute.items()},
        transfer={k: statistics.median(v) for k, v in transfer.items()},
        dp_reduce={k: min(v) for k, v in dp_reduce.items()},
        tie_reduce=min(tie) if tie else 0.0,
        overhead_s=max(0.0, step_s - span),
    )


@dataclass(frozen=True)
class Breakdown:
    """A predicted step's seconds, means over the pipeline ranks: they add up to the step."""

    compute_s: float
    pp_comm_s: float
    dp_comm_s: float
    tie_comm_s: float
    bubble_s: float
    overhead_s: float


@dataclass(frozen=True)
class MeasuredStep:
    """The run the costs were measured on."""

    microbatches: int
    schedule: str
    iteration_s: float


@dataclass(frozen=True)
class Calibrated:
    """``predict``'s summary: the layout, its predicted step and what it was measured on
    (``to_json()`` is ``autopart simulate --measured --json``'s output)."""

    schedule: str
    pp: int
    dp: int
    tp: int
    virtual_stages: int
    seq_chunks: int
    microbatches: int
    iteration_s: float
    tokens_per_s: float | None
    bubble_fraction: float
    breakdown: Breakdown
    measured: MeasuredStep

    def to_json(self) -> dict[str, Any]:
        return {"calibrated": True, **asdict(self)}


@dataclass(frozen=True)
class Prediction:
    """``predict``'s answer: the simulated step and its summary."""

    timeline: Timeline
    summary: Calibrated


def predict(
    m: Measured, microbatches: int | None = None, schedule: str | None = None, record: bool = False
) -> Prediction:
    """The step time of the measured layout with ``microbatches`` and ``schedule`` (default: the
    measured run's), from the measured per-action costs. The schedule may change only among
    those with the same units: ``gpipe`` ↔ ``1f1b``; Seq1F1B with the measured chunk count and
    interleaving with the measured virtual stages stay as they are."""
    mb = m.microbatches if microbatches is None else microbatches
    name = schedule or m.schedule
    if mb < 1:
        raise AutopartError(f"{mb} micro-batches: need at least 1")
    check_schedule(name, m.pp, mb, v=m.virtual_stages, k=m.seq_chunks)
    if traits(name) != traits(m.schedule):  # chunks, virtual stages, a split backward
        raise AutopartError(
            f"the trace measured {m.schedule}; its costs cannot predict {name}",
            hint="sequence chunks, virtual stages and a split backward change every action's cost: "
            f"measure a run of {name} (autopart run DIR --trace FILE)",
        )
    actions = {
        r: generate(
            name,
            r,
            mb,
            list(range(m.pp)),
            dp=m.dp,
            v=m.virtual_stages,
            tied=r in m.tied_pp_ranks,
            k=m.seq_chunks,
        )
        for r in range(m.pp)
    }
    missing = sorted(
        {
            (a.kind, a.stage, a.chunk)
            for acts in actions.values()
            for a in acts
            if a.kind in ("F", "B", "W")
        }
        - set(m.compute)
    )
    if missing:
        kind, stage, chunk = missing[0]
        raise AutopartError(
            f"the trace holds no measured {kind} of stage {stage}, chunk {chunk}",
            hint="measure a full step of this layout: autopart run DIR --trace FILE",
        )
    by_kind = {
        kind: statistics.median(t for (k, _), t in m.transfer.items() if k == kind)
        for kind in {k for k, _ in m.transfer}
    }
    fallback = statistics.median(m.transfer.values()) if m.transfer else 0.0

    def transfer(a: Action) -> float:  # a chunk whose receiver never waited: its kind's median
        return m.transfer.get((a.kind, a.chunk), by_kind.get(a.kind, fallback))

    def cost(a: Action) -> float:
        if a.kind == "TIE_REDUCE":
            return m.tie_reduce
        if a.kind == "DP_REDUCE":
            return m.dp_reduce.get(a.stage, 0.0)
        return m.compute[(a.kind, a.stage, a.chunk)]

    tl = simulate_actions(actions, cost, transfer, record=record)
    step = tl.span + m.overhead_s
    ranks = tl.ranks.values()
    n = m.pp  # means over the pipeline ranks: with the bubble and the overhead, they add up
    busy, exposed = sum(rt.busy for rt in ranks) / n, sum(rt.recv_exposed for rt in ranks) / n
    dp_wait, tie_wait = sum(rt.dp_wait for rt in ranks) / n, sum(rt.tie_wait for rt in ranks) / n
    bubble = tl.span - (busy + exposed + dp_wait + tie_wait)
    summary = Calibrated(
        schedule=name,
        pp=m.pp,
        dp=m.dp,
        tp=m.tp,
        virtual_stages=m.virtual_stages,
        seq_chunks=m.seq_chunks,
        microbatches=mb,
        iteration_s=step,
        tokens_per_s=mb * m.microbatch_tokens * m.dp / step if m.microbatch_tokens else None,
        bubble_fraction=bubble / step,
        breakdown=Breakdown(busy, exposed, dp_wait, tie_wait, bubble, m.overhead_s),
        measured=MeasuredStep(m.microbatches, m.schedule, m.step_s),
    )
    return Prediction(tl, summary)


def print_prediction(s: Calibrated, console: Any) -> None:
    """The human-readable form of ``predict``'s summary (``autopart simulate --measured``)."""
    from rich.table import Table

    meas = s.measured
    chunks = f", {s.seq_chunks} chunks" if s.seq_chunks > 1 else ""
    virtual = f", v={s.virtual_stages}" if s.virtual_stages > 1 else ""
    console.print(
        f"calibrated prediction: {s.schedule}, pp={s.pp} tp={s.tp} dp={s.dp}{virtual}"
        f"{chunks}, {s.microbatches} micro-batches (costs measured on "
        f"{meas.schedule}, {meas.microbatches} micro-batches)"
    )
    t = Table(show_header=False, box=None)
    t.add_row("step time", f"{s.iteration_s * 1e3:.1f} ms")
    if s.tokens_per_s:
        t.add_row("tokens/s", f"{s.tokens_per_s:.0f}")
    t.add_row("bubble fraction", f"{s.bubble_fraction:.3f}")
    for k, v in asdict(s.breakdown).items():
        t.add_row(f"  {k[:-2].replace('_', ' ')}", f"{v * 1e3:.1f} ms")
    same = s.microbatches == meas.microbatches and s.schedule == meas.schedule
    t.add_row(
        "measured step"
        + (" (the same run)" if same else f" ({meas.schedule}, {meas.microbatches} micro-batches)"),
        f"{meas.iteration_s * 1e3:.1f} ms",
    )
    console.print(t)
