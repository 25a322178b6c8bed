"""Pipeline timeline pictures: one row per rank, from Chrome/Perfetto trace events.

The runtime records a ``TraceEvent`` (action, start, end) per executed action; ``chrome_event``
turns an action and its times into the trace event that ``Runner.chrome_trace``, the
simulator's ``to_chrome_trace`` and ``python -m autopart.runtime.run DIR --trace FILE`` write::

    {"name": "F(s0,m1,c2)", "cat": "F", "ph": "X", "pid": rank, "tid": 0, "ts": µs, "dur": µs,
     "args": {"kind": "F", "stage": 0, "mb": 1, "chunk": 2, "peer": null}}

``name`` is for reading (Perfetto shows it); ``args`` holds the action's fields, which
``event_action`` reads back. An event without them (another tool's trace) is drawn as a plain
block of its ``cat``.

    events = load_trace("trace.json")
    plot_timeline(events, "timeline.png", title="seq1f1b, pp=2")
    busy_fractions(events)   # {0: 0.81, 1: 0.74}

Forward and backward blocks are coloured by micro-batch (backward darker and hatched), Seq1F1B
chunks get lighter with the chunk index, communication is a thin grey bar under the row, idle
time stays white, and each row ends with that rank's busy fraction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopart.errors import AutopartError
from autopart.schedule.ir import KINDS, Action

COMPUTE = ("F", "B", "W")  # W: a zero-bubble schedule's deferred weight gradients
_SEND_RECV = "#a0a0a0"  # SEND_F/RECV_F/SEND_B/RECV_B
_REDUCE = "#505050"  # DP_REDUCE/TIE_REDUCE
_OTHER = "#c8c8c8"  # anything else a trace holds


@dataclass(frozen=True)
class TraceEvent:
    """One action as a rank ran it: start and end in seconds (``time.time()`` in a run)."""

    action: Action
    start: float
    end: float

    @property
    def dur(self) -> float:
        return self.end - self.start


HEADER = "autopart"  # the trace's top-level key holding the run's plan and step time
VERSION = 2  # 2: each event's action in its "args" (1: only in its name)


def trace_document(events: list[dict[str, Any]], header: dict[str, Any]) -> dict[str, Any]:
    """The JSON object ``autopart run --trace`` writes: the events and the run's header, which
    ``autopart simulate --measured`` reads (``planning/calibrate.py``)."""
    return {"traceEvents": events, "displayTimeUnit": "ms", HEADER: {"version": VERSION, **header}}


def chrome_event(
    action: Action, start: float, end: float, pid: int, tid: int = 0
) -> dict[str, Any]:
    """The Chrome/Perfetto complete ("X") event of ``action`` run from ``start`` to ``end``
    (seconds) on rank ``pid``: ``ts``/``dur`` in µs, ``name`` the readable ``str(action)``,
    ``args`` the action's fields (``event_action`` reads them back)."""
    return {
        "name": str(action),
        "cat": action.kind,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start * 1e6,
        "dur": (end - start) * 1e6,
        "args": {
            "kind": action.kind,
            "stage": action.stage,
            "mb": action.mb,
            "chunk": action.chunk,
            "peer": action.peer,
        },
    }


def _index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def event_action(event: dict[str, Any]) -> Action | None:
    """The action a trace event records in its ``args`` (as ``chrome_event`` writes them), or
    None when it records none: no ``args``, or ``args`` that are not an autopart action's (an
    unknown kind, a stage, micro-batch, chunk or peer that is not a whole number ≥ 0)."""
    args = event.get("args")
    if not isinstance(args, dict) or args.get("kind") not in KINDS:
        return None
    fields = {k: args.get(k, 0) for k in ("stage", "mb", "chunk")}
    peer = args.get("peer")
    if not all(_index(v) for v in fields.values()) or not (peer is None or _index(peer)):
        return None
    return Action(args["kind"], **fields, peer=peer)


@dataclass(frozen=True)
class Block:
    """One complete ("X") trace event, read: times in µs as in the trace."""

    rank: int
    kind: str
    start: float
    dur: float
    action: Action | None  # None when the event's args record no autopart action

    @property
    def end(self) -> float:
        return self.start + self.dur


def blocks(events: list[dict[str, Any]]) -> list[Block]:
    """The complete ("X") events with a start and a duration, as ``Block``s.

    The action is ``event_action``'s (None for an event without autopart ``args``); the kind is
    that action's, else the event's ``cat`` (or ``"?"``) as it stands.
    """
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph", "X") != "X":
            continue
        ts, dur = e.get("ts"), e.get("dur")
        if not isinstance(ts, int | float) or not isinstance(dur, int | float):
            continue
        try:
            rank = int(e.get("pid", 0))
        except (TypeError, ValueError):
            continue
        action = event_action(e)
        kind = action.kind if action is not None else str(e.get("cat") or "?")
        out.append(Block(rank, kind, float(ts), max(float(dur), 0.0), action))
    return out


def busy_fractions(events: list[dict[str, Any]]) -> dict[int, float]:
    """Per rank: the time in ``F``, ``B`` and ``W`` divided by the step's span.

    The span runs from the earliest start to the latest end over every rank's events (ranks
    record ``time.time()``, so their clocks agree on one machine), so a rank waiting in the
    pipeline bubble before its first action counts as idle. Overlapping compute is counted
    once. ``Runner.busy_fraction`` divides by the rank's own span instead, which is the same
    when every rank records the whole step (as the runtime does: it records the waits too).
    Empty input gives ``{}``.
    """
    bs = blocks(events)
    if not bs:
        return {}
    span = max(b.end for b in bs) - min(b.start for b in bs)
    out: dict[int, float] = {}
    for rank in sorted({b.rank for b in bs}):
        busy, until = 0.0, float("-inf")
        for b in sorted(
            (b for b in bs if b.rank == rank and b.kind in COMPUTE), key=lambda b: b.start
        ):
            if b.end > until:  # the part of this block not already counted
                busy += b.end - max(b.start, until)
                until = b.end
        out[rank] = busy / span if span > 0 else 0.0
    return out


def read_json(path: str | Path) -> Any:
    """A trace file's parsed JSON, or an ``AutopartError`` saying why it cannot be read."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise AutopartError(
            f"no trace file {path}",
            hint="write one with: autopart run DIR --steps 3 --trace FILE.json",
        ) from None
    except (OSError, ValueError, RecursionError) as exc:  # also a 5000-digit integer, nesting
        raise AutopartError(f"{path} is not a readable trace JSON: {exc}") from None


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a Chrome/Perfetto trace JSON: ``{"traceEvents": [...]}`` or a bare list."""
    data = read_json(path)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise AutopartError(
            f"{path} holds no trace events",
            hint='expected {"traceEvents": [{...}, ...]} or a list of event objects',
        )
    return events


def _mix(rgb: tuple[float, ...], to: float, amount: float) -> tuple[float, float, float]:
    """``rgb`` moved ``amount`` (0..1) of the way towards grey level ``to`` (0 black, 1 white)."""
    r, g, b = rgb[:3]
    return (r + (to - r) * amount, g + (to - g) * amount, b + (to - b) * amount)


def plot_timeline(events: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Draw the pipeline timeline of ``events`` to the PNG ``path`` (matplotlib, Agg); returns it.

    One row per rank (pid), rank 0 on top; x in ms from the earliest event. ``F``/``B`` blocks
    are coloured by micro-batch, the same colour for both, ``B`` darker and hatched; Seq1F1B
    chunk j of k is lighter the larger j is (chunk 0 full colour). SEND/RECV and the DP/tie
    reduces are thin bars under the row, idle time is white, and the row ends with the rank's
    busy fraction (``busy_fractions``). Raises ``AutopartError`` when there is nothing to draw.
    """
    bs = blocks(events)
    if not bs:
        raise AutopartError(
            "no timeline events to plot",
            hint="pass complete ('ph': 'X') events with ts and dur, e.g. from "
            "autopart run DIR --trace FILE.json",
        )
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    ranks = sorted({b.rank for b in bs})
    row = {r: i for i, r in enumerate(ranks)}
    t0 = min(b.start for b in bs)
    span_ms = max((max(b.end for b in bs) - t0) / 1e3, 1e-9)
    compute = [b for b in bs if b.kind in COMPUTE]
    mbs = sorted({b.action.mb for b in compute if b.action is not None})
    n_chunks = 1 + max((b.action.chunk for b in compute if b.action is not None), default=0)
    if len(mbs) <= 10:
        palette = [colormaps["tab10"](i) for i in range(10)]
    else:  # tab20's dark half first, then its light half
        palette = [colormaps["tab20"](i) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    base = {m: palette[i % len(palette)] for i, m in enumerate(mbs)}

    def colour(b: Block) -> tuple[float, float, float]:
        c = base[b.action.mb] if b.action is not None else (0.6, 0.6, 0.6)
        if b.kind in ("B", "W"):
            c = _mix(c, 0.0, 0.3 if b.kind == "B" else 0.5)
        if n_chunks > 1 and b.action is not None:
            c = _mix(c, 1.0, 0.55 * b.action.chunk / (n_chunks - 1))
        return c[:3]

    width_in = 12.0
    fig = Figure(figsize=(width_in, 1.2 + 0.55 * len(ranks)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    h = 0.7
    for kind, hatch in (("F", None), ("B", "//"), ("W", "..")):
        mine = [b for b in compute if b.kind == kind]
        if mine:
            ax.barh(
                [row[b.rank] for b in mine],
                [b.dur / 1e3 for b in mine],
                height=h,
                left=[(b.start - t0) / 1e3 for b in mine],
                color=[colour(b) for b in mine],
                edgecolor="white",
                linewidth=0.4,
                hatch=hatch,
                align="center",
            )
    thin = [b for b in bs if b.kind not in COMPUTE]
    if thin:
        ax.barh(
            [row[b.rank] + h / 2 + 0.07 for b in thin],
            [b.dur / 1e3 for b in thin],
            height=0.1,
            left=[(b.start - t0) / 1e3 for b in thin],
            linewidth=0,
            color=[
                _REDUCE if "REDUCE" in b.kind else _SEND_RECV if b.kind in KINDS else _OTHER
                for b in thin
            ],
            align="center",
        )

    ax.set_xlim(0, span_ms)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("time (ms) from the first event")
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or "pipeline timeline", loc="left", fontsize=11)

    # labels ("F1", "B1.2" = backward of micro-batch 1, chunk 2) where they fit
    axes_px = ax.get_position().width * width_in * fig.dpi
    for b in compute:
        if b.action is None:
            continue
        label = f"{b.kind}{b.action.mb}" + (f".{b.action.chunk}" if n_chunks > 1 else "")
        if b.dur / 1e3 / span_ms * axes_px > 6.5 * len(label) + 4:
            dark = b.kind == "W" or (
                b.kind == "B" and not (n_chunks > 1 and b.action.chunk == n_chunks - 1)
            )
            ax.text(
                (b.start - t0 + b.dur / 2) / 1e3,
                row[b.rank],
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white" if dark else "black",
            )

    margin = blended_transform_factory(ax.transAxes, ax.transData)
    for r, frac in busy_fractions(events).items():
        ax.text(1.01, row[r], f"{frac:.0%} busy", transform=margin, va="center", fontsize=9)

    grey = (0.55, 0.55, 0.55)
    handles = [Patch(color=base[m], label=f"m{m}") for m in mbs]
    if compute:
        handles += [
            Patch(facecolor=grey, edgecolor="white", label="F"),
            Patch(facecolor=_mix(grey, 0.0, 0.3), edgecolor="white", hatch="//", label="B"),
        ]
        if any(b.kind == "W" for b in compute):
            handles.append(
                Patch(facecolor=_mix(grey, 0.0, 0.5), edgecolor="white", hatch="..", label="W")
            )
    handles += (
        [
            Patch(color=_mix(grey, 1.0, 0.55 * c / (n_chunks - 1)), label=f"chunk {c}")
            for c in range(n_chunks)
        ]
        if n_chunks > 1
        else []
    )
    kinds = {b.kind for b in thin}
    if kinds & {"SEND_F", "RECV_F", "SEND_B", "RECV_B"}:
        handles.append(Patch(color=_SEND_RECV, label="send/recv"))
    if kinds & {"DP_REDUCE", "TIE_REDUCE"}:
        handles.append(Patch(color=_REDUCE, label="reduce"))
    axes_h_in = ax.get_position().height * fig.get_figheight()  # the legend 0.6 in below it
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.6 / axes_h_in),
        ncol=min(len(handles), 10),
        fontsize=8,
        frameon=False,
    )

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path
