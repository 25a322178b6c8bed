"""The event simulator: per-rank action lists timed by per-action costs and a speed model
(``simulate_actions``; one event loop, ``_run``), a ``Timeline`` of events and per-rank busy and
waiting times, and its Chrome trace."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from autopart.errors import AutopartError
from autopart.planning.simulate.speed import DEDICATED, SpeedModel
from autopart.runtime.timeline import chrome_event
from autopart.schedule.ir import Action


class Event(NamedTuple):
    """One action's span on one rank (seconds from the iteration's start)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def name(self) -> str:
        return str(self.action)  # as Action.__str__ prints: F(s0,m1,c2), SEND_F(s0,m0)→r1

    @property
    def kind(self) -> str:
        return self.action.kind


@dataclass
class RankTimes:
    """What a rank's time went to (seconds)."""

    end: float = 0.0  # when its last action ended
    busy: float = 0.0  # F and B
    recv_wait: float = 0.0  # RECV waits, all of them
    recv_exposed: float = 0.0  # the part of each RECV wait no longer than its transfer
    dp_wait: float = 0.0  # DP_REDUCE waits
    tie_wait: float = 0.0  # TIE_REDUCE (start to end)

    def scaled(self, other: RankTimes, x: float) -> RankTimes:
        """self + x · (other − self), field by field (linear extrapolation)."""
        return RankTimes(
            *(a + x * (b - a) for a, b in zip(_astuple(self), _astuple(other), strict=True))
        )


def _astuple(rt: RankTimes) -> tuple[float, ...]:
    return (rt.end, rt.busy, rt.recv_wait, rt.recv_exposed, rt.dp_wait, rt.tie_wait)


@dataclass
class Timeline:
    """The result of ``simulate_actions``."""

    span: float  # from 0 to the last action's end, over all ranks
    ranks: dict[int, RankTimes]
    events: list[Event] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of (span − the rank's F and B time) / span."""
        if self.span <= 0:
            return 0.0
        return sum(self.span - rt.busy for rt in self.ranks.values()) / (
            len(self.ranks) * self.span
        )


_FB, _SEND, _RECV, _DP, _TIE = range(5)
_MATCH = {"RECV_F": "SEND_F", "RECV_B": "SEND_B"}


class _Compiled(NamedTuple):
    ranks: list[int]
    ops: list[list[tuple[int, int, int]]]  # per rank index: (code, cost key, message)
    keys: list[Action]  # a representative action per cost key
    is_send_key: list[bool]
    key_stage: list[int]
    n_msgs: int
    dp_keys: list[dict[int, int]]  # per rank index: stage → cost key of its DP reduction
    # per rank index: (position of a unit's B, position of its W), in the order of the B's
    deferred: list[list[tuple[int, int]]]


def _compile(actions_by_rank: dict[int, list[Action]]) -> _Compiled:
    ranks = sorted(actions_by_rank)
    keys: dict[tuple, int] = {}
    reps: list[Action] = []
    is_send: list[bool] = []

    def key(k: tuple, a: Action, send: bool) -> int:
        if k not in keys:
            keys[k] = len(reps)
            reps.append(a)
            is_send.append(send)
        return keys[k]

    msgs: dict[tuple, int] = {}

    def msg(k: tuple) -> int:
        return msgs.setdefault(k, len(msgs))

    ops, dp_keys, deferred = [], [], []
    for r in ranks:
        row: list[tuple[int, int, int]] = []  # (op code, cost key, message)
        stages: list[int] = []
        b_at: dict[tuple[int, int, int], int] = {}
        pairs: list[tuple[int, int]] = []
        for a in actions_by_rank[r]:
            kind = a.kind
            if kind in ("F", "B", "W"):
                if kind == "B":
                    b_at[(a.stage, a.mb, a.chunk)] = len(row)
                elif kind == "W":
                    # (a W without its B first: never run early)
                    pairs.append((b_at.get((a.stage, a.mb, a.chunk), len(row)), len(row)))
                row.append((_FB, key((kind, a.stage, a.chunk), a, False), -1))
                if kind != "F" and a.stage not in stages:
                    stages.append(a.stage)
            elif kind in ("SEND_F", "SEND_B"):
                kk = key((kind, a.stage, a.chunk, r, a.peer), a, True)
                row.append((_SEND, kk, msg((kind, r, a.peer, a.stage, a.mb, a.chunk))))
            elif kind in _MATCH:
                stage = a.stage - 1 if kind == "RECV_F" else a.stage + 1
                row.append((_RECV, -1, msg((_MATCH[kind], a.peer, r, stage, a.mb, a.chunk))))
            elif kind == "DP_REDUCE":
                row.append((_DP, -1, -1))
            elif kind == "TIE_REDUCE":
                row.append((_TIE, key(("TIE",), a, False), -1))
            else:
                raise AutopartError(f"rank {r}: cannot simulate action {a}")
        ops.append(row)
        dp_keys.append({s: key(("DP", s), Action("DP_REDUCE", s), False) for s in stages})
        deferred.append(sorted(pairs))
    return _Compiled(
        ranks, ops, reps, is_send, [a.stage for a in reps], len(msgs), dp_keys, deferred
    )


def _w_left(comp: _Compiled, cost: list[float], fill_waits: bool) -> list[dict[int, float]]:
    """Per rank index: the seconds left of each deferred W (by position), which a rank filling
    its waits runs down before the schedule reaches it (a W pops its entry when it runs);
    empty without ``fill_waits``."""
    if not fill_waits:
        return [{} for _ in comp.ops]
    return [
        {w: cost[ops[w][1]] for _, w in pairs}
        for ops, pairs in zip(comp.ops, comp.deferred, strict=True)
    ]


def _pending(comp: _Compiled, i: int, p: int, left: dict[int, float]) -> int:
    """Position of the oldest W of rank index i whose B ran before position p and whose work
    is not done (-1: none)."""
    for b, w in comp.deferred[i]:
        if b >= p:
            return -1
        if w > p and left[w] > 0.0:
            return w
    return -1


def simulate_actions(
    actions_by_rank: dict[int, list[Action]],
    cost_fn: Callable[[Action], float],
    comm_fn: Callable[[Action], float] | None = None,
    record: bool = True,
    grad_overlap: bool = True,
    p2p_overlap: bool = True,
    fill_waits: bool = False,
    speed: SpeedModel = DEDICATED,
    placement: Mapping[int, tuple[int, float]] | None = None,
) -> Timeline:
    """Time every rank's action list (see the module docstring for the rules).

    ``cost_fn(action)`` gives the seconds of an ``F`` or ``B``, of ``TIE_REDUCE``, and of the
    gradient reduction of one stage for ``Action("DP_REDUCE", stage)``; it is called once per
    distinct (kind, stage, chunk), so it may depend on nothing else. ``comm_fn(action)`` gives a
    ``SEND``'s transfer seconds (once per distinct kind, stage, chunk and peer); ``None`` means
    free communication. ``record=False`` skips the events (faster). ``grad_overlap=False``
    starts the gradient reductions only at ``DP_REDUCE``, after the rank's last backward
    (Megatron-LM 2021), instead of at the start of each stage's last backward.
    ``p2p_overlap=False`` makes a ``SEND`` block its rank until the message has arrived.
    ``fill_waits``: a rank waiting for a receive runs its deferred ``W`` work meanwhile.
    ``speed``: how computing ranks on one node slow each other (``DEDICATED``: not at all);
    ``placement``: rank → (its node, the processes it stands for); default: every rank one
    process, all on one node.
    """
    comp = _compile(actions_by_rank)
    comm_fn = comm_fn or (lambda a: 0.0)
    cost = [
        comm_fn(a) if s else cost_fn(a) for a, s in zip(comp.keys, comp.is_send_key, strict=True)
    ]
    place = [placement[r] if placement else (0, 1.0) for r in comp.ranks]
    acts = actions_by_rank if record else None
    return _run(comp, cost, acts, grad_overlap, p2p_overlap, fill_waits, speed, place)


def _run(
    comp: _Compiled,
    cost: list[float],
    actions: dict[int, list[Action]] | None,
    grad_overlap: bool,
    p2p_overlap: bool,
    fill_waits: bool,
    speed: SpeedModel,
    placement: list[tuple[int, float]],
) -> Timeline:
    """The event loop. ``cost`` holds each action's seconds alone. Rank index i stands for
    ``placement[i][1]`` processes on node ``placement[i][0]``; while the processes computing an
    F, B or W on a node number c, each takes ``speed.crowding(c)`` times as long (processor
    sharing: transfers and reductions take no core, and a waiting rank leaves its share to the
    others). ``fill_waits``: a rank whose receive has not arrived runs its deferred W work
    meanwhile, oldest first (``_pending``), and the W itself later runs what is left of it (the
    runtime's work while waiting on CPU ranks).

    A heap holds when each rank goes on next: a compute's end, a wait's end, a message's
    arrival. A rank runs on by itself while its clock stays at or below the heap's earliest
    time, since nothing can change its speed before then; when no node's speed can ever change
    (``free``: ``DEDICATED``), without limit, until it waits for a message or a meeting."""
    n = len(comp.ranks)
    ops_of, stage_of = comp.ops, comp.key_stage
    w_left = _w_left(comp, cost, fill_waits)
    pc = [0] * n
    now = [0.0] * n  # a rank's clock while it does not compute
    computing = [False] * n
    left = [0.0] * n  # seconds alone of the current compute still to run, as of ``since``
    since = [0.0] * n
    began = [0.0] * n
    fin = [0.0] * n  # when the current compute ends at its node's present speed
    filling = [-1] * n  # the position of the W a rank runs a piece of while it waits, or -1
    arrival: list[float | None] = [None] * comp.n_msgs
    xfer = [0.0] * comp.n_msgs
    waiter = [-1] * comp.n_msgs
    times = [RankTimes() for _ in range(n)]
    last_b: list[dict[int, tuple[float, float]]] = [{} for _ in range(n)]
    tie_n = sum(1 for row in comp.ops if any(op[0] == _TIE for op in row))
    tie_at: dict[int, float] = {}
    raw: list[tuple[int, int, float, float]] = []
    rec = actions is not None
    node = [nd for nd, _ in placement]
    weight = [w for _, w in placement]
    members: dict[int, list[int]] = {}
    for i, nd in enumerate(node):
        members.setdefault(nd, []).append(i)
    load = dict.fromkeys(members, 0.0)  # processes computing on each node
    factor = dict.fromkeys(members, 1.0)  # speed.crowding of that load
    # no node slowed even with all its processes computing: no rank's speed ever changes
    free = all(speed.crowding(sum(weight[i] for i in ids)) == 1.0 for ids in members.values())
    version = [0] * n  # a heap entry of rank i counts while it carries version[i]
    heap = [(0.0, i, 0) for i in range(n)]

    def horizon() -> float:
        """The earliest time another rank goes on (stale entries dropped)."""
        while heap and heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def wake(i: int, t: float) -> None:
        version[i] += 1
        heapq.heappush(heap, (t, i, version[i]))

    def until(i: int) -> float:
        """When rank i's compute stops: its end, or, filling a wait, the data's arrival."""
        at = arrival[ops_of[i][pc[i]][2]] if filling[i] >= 0 else None
        return fin[i] if at is None else min(fin[i], at)

    def crowd(i: int, t: float, change: float) -> float:
        """``change`` processes more compute on rank i's node from t (i not counted among
        them): the others go on at the node's new speed. Returns that speed's factor."""
        nd = node[i]
        load[nd] += change
        old, new = factor[nd], speed.crowding(load[nd])
        if new != old:
            factor[nd] = new
            for j in members[nd]:
                if computing[j]:
                    left[j] -= (t - since[j]) / old
                    since[j], fin[j] = t, t + left[j] * new
                    wake(j, until(j))
        return new

    def start(i: int, t: float, seconds: float, w: int) -> None:
        """Rank i computes ``seconds`` alone from t: an action, or a piece of the W at w."""
        f = 1.0 if free else crowd(i, t, weight[i])
        computing[i], filling[i] = True, w
        left[i], since[i], began[i], fin[i] = seconds, t, t, t + seconds * f

    def stop(i: int, t: float) -> None:
        """Rank i's compute stops at t: its action ends, or its piece of a W (done, or the
        data came)."""
        w = filling[i]
        if w >= 0:
            done = fin[i] <= t
            w_left[i][w] = 0.0 if done else left[i] - (t - since[i]) / factor[node[i]]
            p = w
        else:
            p = pc[i]
            last_b[i][stage_of[ops_of[i][p][1]]] = (began[i], t)
            pc[i] += 1
        computing[i], filling[i] = False, -1
        if not free:
            crowd(i, t, -weight[i])
        if t > began[i] or w < 0:
            times[i].busy += t - began[i]
            if rec:
                raw.append((i, p, began[i], t))

    def resume(i: int, t: float) -> None:
        """Run rank i from t until it must wait for the heap, for a message or a meeting, or
        ends."""
        ops, rt, wl = ops_of[i], times[i], w_left[i]
        last = len(ops)
        while True:
            if computing[i]:
                end = fin[i] if filling[i] < 0 else until(i)
                if not free and end > horizon():
                    wake(i, end)
                    return
                stop(i, end)
                t = end
            elif not free and t > horizon():
                now[i] = t
                wake(i, t)
                return
            p = pc[i]
            if p == last:
                now[i] = t
                return
            code, key, m = ops[p]
            if code == _FB:
                d = wl.pop(p, cost[key]) if wl else cost[key]  # what filling left of a W
                if d > 0:
                    start(i, t, d, -1)
                    continue
                last_b[i][stage_of[key]] = (t, t)
                if rec:
                    raw.append((i, p, t, t))
            elif code == _SEND:
                sent = arrival[m] = t + cost[key]
                xfer[m] = cost[key]
                w = waiter[m]
                if w >= 0:  # it goes on where it waits, or its piece of a W stops then
                    waiter[m] = -1
                    wake(w, until(w) if computing[w] else now[w])
                if rec:
                    raw.append((i, p, t, t if p2p_overlap else sent))
                if not p2p_overlap:  # a blocking send: the sender waits for the delivery
                    rt.recv_wait += cost[key]
                    rt.recv_exposed += cost[key]
                    t = sent
            elif code == _RECV:
                at = arrival[m]
                w = _pending(comp, i, p, wl) if wl and (at is None or at > t) else -1
                if at is None and (w < 0 or free):  # ``free``: the sender may be behind
                    waiter[m], now[i] = i, t
                    return
                if w >= 0:  # a piece of that W, until the data is there
                    if at is None:
                        waiter[m] = i
                    start(i, t, wl[w], w)
                    continue
                assert at is not None  # not sent yet: returned or filling above
                end = max(t, at)
                rt.recv_wait += end - t
                rt.recv_exposed += min(end - t, xfer[m])
                if rec:
                    raw.append((i, p, t, end))
                t = end
            elif code == _DP:
                comm = 0.0
                for s, (b0, b1) in sorted(last_b[i].items(), key=lambda kv: kv[1][0]):
                    first = b0 if grad_overlap else t  # overlapped, or after the last backward
                    comm = max(max(comm, first) + cost[comp.dp_keys[i][s]], b1)
                done = max(t, comm)
                rt.dp_wait += done - t
                if rec:
                    raw.append((i, p, t, done))
                t = done
            else:  # _TIE: every rank that has one meets
                tie_at[i] = t
                if len(tie_at) < tie_n:
                    now[i] = t
                    return
                done = max(tie_at.values()) + cost[key]
                for j, arrived in tie_at.items():
                    times[j].tie_wait += done - arrived
                    if rec:
                        raw.append((j, pc[j], arrived, done))
                    if j != i:
                        now[j], pc[j] = done, pc[j] + 1
                        wake(j, done)
                tie_at.clear()
                t = done
            pc[i] += 1

    while heap:
        t, i, v = heapq.heappop(heap)
        if v == version[i]:
            resume(i, t)
    return _finish(comp, now, pc, times, raw, actions)


def _finish(
    comp: _Compiled,
    now: list[float],
    pc: list[int],
    times: list[RankTimes],
    raw: list[tuple[int, int, float, float]],
    actions: dict[int, list[Action]] | None,
) -> Timeline:
    """The timeline of a finished run (or the deadlock error of a stuck one)."""
    n = len(comp.ranks)
    stuck = [(comp.ranks[i], pc[i]) for i in range(n) if pc[i] < len(comp.ops[i])]
    if stuck:
        raise AutopartError(
            "simulated schedule deadlocks: "
            + ", ".join(f"rank {r} waits at step {p}" for r, p in stuck[:4]),
            hint="check it with autopart.schedule.verify",
        )
    for i in range(n):
        times[i].end = now[i]
    span = max(now, default=0.0)
    events = []
    if actions is not None:
        for i, p, s, e in raw:
            r = comp.ranks[i]
            events.append(Event(r, actions[r][p], s, e))
        events.sort(key=lambda ev: (ev.rank, ev.start))
    return Timeline(span, {comp.ranks[i]: times[i] for i in range(n)}, events)


def to_chrome_trace(events: list[Event]) -> list[dict[str, Any]]:
    """Events as Chrome/Perfetto trace events, in ``Runner.chrome_trace``'s format
    (``autopart.runtime.timeline.chrome_event``: the action's fields in ``args``)."""
    return [chrome_event(ev.action, ev.start, ev.end, ev.rank) for ev in events]
