"""The event simulator: per-rank action lists timed by per-action costs (``simulate_actions``),
a ``Timeline`` of events and per-rank busy and waiting times, and its Chrome trace."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from autopart.errors import AutopartError
from autopart.planning.cluster import crowding
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
    shared_cores: float = 0.0,
    fill_waits: bool = False,
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
    ``shared_cores`` > 0: the ranks are processes sharing that many cores (``_run_shared``).
    ``fill_waits``: a rank waiting for a receive runs its deferred ``W`` work meanwhile.
    """
    comp = _compile(actions_by_rank)
    comm_fn = comm_fn or (lambda a: 0.0)
    cost = [
        comm_fn(a) if s else cost_fn(a) for a, s in zip(comp.keys, comp.is_send_key, strict=True)
    ]
    acts = actions_by_rank if record else None
    if shared_cores:
        n = len(comp.ranks)
        return _run_shared(
            comp,
            cost,
            acts,
            grad_overlap,
            p2p_overlap,
            [1.0] * n,
            [0] * n,
            shared_cores,
            fill_waits=fill_waits,
        )
    return _run(comp, cost, acts, grad_overlap, p2p_overlap, fill_waits)


def _run(
    comp: _Compiled,
    cost: list[float],
    actions: dict[int, list[Action]] | None,
    grad_overlap: bool = True,
    p2p_overlap: bool = True,
    fill_waits: bool = False,
) -> Timeline:
    """Every rank on its own device. ``fill_waits``: a rank whose receive has not arrived runs
    its deferred W work meanwhile, oldest first (``_pending``), and the W itself later runs
    what is left of it (the runtime's work while waiting on CPU ranks)."""
    n = len(comp.ranks)
    w_left = _w_left(comp, cost, fill_waits)
    now = [0.0] * n
    pc = [0] * n
    arrival: list[float | None] = [None] * comp.n_msgs
    xfer = [0.0] * comp.n_msgs
    waiter = [-1] * comp.n_msgs
    times = [RankTimes() for _ in range(n)]
    last_b: list[dict[int, tuple[float, float]]] = [{} for _ in range(n)]
    tie_at: dict[int, float] = {}
    tie_n = sum(1 for row in comp.ops if any(op[0] == _TIE for op in row))
    raw: list[tuple[int, int, float, float]] = []
    rec = actions is not None
    stage_of = comp.key_stage
    stack = list(range(n - 1, -1, -1))
    while stack:
        i = stack.pop()
        ops, t, p, rt = comp.ops[i], now[i], pc[i], times[i]
        end = len(ops)
        wl = w_left[i]
        while p < end:
            code, key, m = ops[p]
            if code == _FB:
                d = cost[key]
                if wl:
                    d = wl.pop(p, d)  # what filling left of a W
                if rec:
                    raw.append((i, p, t, t + d))
                lb = last_b[i]
                lb[stage_of[key]] = (t, t + d)  # F entries are overwritten by later B's
                t += d
                rt.busy += d
            elif code == _SEND:
                sent = arrival[m] = t + cost[key]
                xfer[m] = cost[key]
                if rec:
                    raw.append((i, p, t, t if p2p_overlap else sent))
                if not p2p_overlap:  # a blocking send: the sender waits for the delivery
                    rt.recv_wait += cost[key]
                    rt.recv_exposed += cost[key]
                    t = sent
                w = waiter[m]
                if w >= 0:
                    waiter[m] = -1
                    stack.append(w)
            elif code == _RECV:
                at = arrival[m]
                if at is None:
                    waiter[m] = i
                    break
                while wl and at > t and (w := _pending(comp, i, p, wl)) >= 0:
                    d = min(wl[w], at - t)  # a piece of that W, until the data is there
                    wl[w] -= d
                    if rec:
                        raw.append((i, w, t, t + d))
                    t += d
                    rt.busy += d
                start = t
                if at > t:
                    rt.recv_wait += at - t
                    rt.recv_exposed += min(at - t, xfer[m])
                    t = at
                if rec:
                    raw.append((i, p, start, t))
            elif code == _DP:
                comm = 0.0
                for s, (b0, b1) in sorted(last_b[i].items(), key=lambda kv: kv[1][0]):
                    start = b0 if grad_overlap else t  # overlapped, or after the last backward
                    comm = max(max(comm, start) + cost[comp.dp_keys[i][s]], b1)
                done = max(t, comm)
                rt.dp_wait += done - t
                if rec:
                    raw.append((i, p, t, done))
                t = done
            else:  # _TIE: every rank that has one meets
                tie_at[i] = t
                if len(tie_at) < tie_n:
                    now[i], pc[i] = t, p
                    break
                done = max(tie_at.values()) + cost[key]
                for j, arrived in tie_at.items():
                    times[j].tie_wait += done - arrived
                    if rec:
                        raw.append((j, _index_of(comp.ops[j], _TIE), arrived, done))
                    if j != i:
                        now[j], pc[j] = done, _index_of(comp.ops[j], _TIE) + 1
                        stack.append(j)
                t = done
            p += 1
        now[i], pc[i] = t, p
    return _finish(comp, now, pc, times, raw, actions)


def _run_shared(
    comp: _Compiled,
    cost: list[float],
    actions: dict[int, list[Action]] | None,
    grad_overlap: bool,
    p2p_overlap: bool,
    weight: list[float],
    node: list[int],
    cores: float,
    slowdown: float = 0.0,
    fill_waits: bool = False,
) -> Timeline:
    """``_run`` for ranks that share ``cores`` cores per node (CPU ranks, more than cores):
    processor sharing in global time order. Rank index i stands for ``weight[i]`` processes on
    node ``node[i]``; while the processes computing F or B on a node outnumber its cores, each
    runs at cores / their number of its full speed (``cost``, seconds alone on a core); while
    more than one computes, each is slowed by 1 + ``slowdown`` again (what sharing the node
    costs beyond the cores: memory bandwidth, caches, and taking turns when they outnumber the
    cores). A rank
    waiting (receive, gradient reduction, tied-weight meeting) leaves its core to the others,
    which is how a pipeline's bubble speeds up the other stages on a shared CPU, unless
    ``fill_waits`` gives it deferred W work to run until its receive arrives (as ``_run``).
    Transfers and reductions are not slowed."""
    n = len(comp.ranks)
    w_left = _w_left(comp, cost, fill_waits)
    filling = [-1] * n  # the position of the W a rank runs a piece of while it waits
    now = [0.0] * n  # when the rank reached its current op
    pc = [0] * n
    left = [0.0] * n  # full-speed seconds of the current F/B still to run (0: not computing)
    began = [0.0] * n
    ready = [0.0] * n  # blocked until then (a receive's arrival, a reduction, a blocking send)
    arrival: list[float | None] = [None] * comp.n_msgs
    xfer = [0.0] * comp.n_msgs
    times = [RankTimes() for _ in range(n)]
    last_b: list[dict[int, tuple[float, float]]] = [{} for _ in range(n)]
    tie_ranks = {i for i, row in enumerate(comp.ops) if any(op[0] == _TIE for op in row)}
    tie_at: dict[int, float] = {}
    raw: list[tuple[int, int, float, float]] = []
    rec = actions is not None
    T = 0.0

    def advance(i: int) -> bool:
        """Run rank i's ops that take no core, from time T; True if it moved."""
        moved = False
        ops, rt = comp.ops[i], times[i]
        while pc[i] < len(ops) and left[i] == 0.0 and ready[i] <= T and i not in tie_at:
            code, key, m = ops[pc[i]]
            t, p = max(now[i], ready[i]), pc[i]
            if code == _FB:
                d = w_left[i].pop(p, cost[key])  # what filling left of a W
                if d > 0:
                    left[i], began[i] = d, t
                    return True
                if rec:
                    raw.append((i, p, t, t))
            elif code == _SEND:
                sent = arrival[m] = t + cost[key]
                xfer[m] = cost[key]
                if not p2p_overlap:
                    rt.recv_wait += cost[key]
                    rt.recv_exposed += cost[key]
                    ready[i] = sent
                if rec:
                    raw.append((i, p, t, t if p2p_overlap else sent))
            elif code == _RECV:
                at = arrival[m]
                if (
                    w_left[i]
                    and (at is None or at > t)
                    and (w := _pending(comp, i, p, w_left[i])) >= 0
                ):
                    left[i], began[i], filling[i] = w_left[i][w], t, w
                    return True
                if at is None:
                    return moved
                end = max(t, at)
                rt.recv_wait += end - t
                rt.recv_exposed += min(end - t, xfer[m])
                ready[i] = end
                if rec:
                    raw.append((i, p, t, end))
            elif code == _DP:
                comm = 0.0
                for s, (b0, b1) in sorted(last_b[i].items(), key=lambda kv: kv[1][0]):
                    start = b0 if grad_overlap else t
                    comm = max(max(comm, start) + cost[comp.dp_keys[i][s]], b1)
                done = max(t, comm)
                rt.dp_wait += done - t
                ready[i] = done
                if rec:
                    raw.append((i, p, t, done))
            else:  # _TIE: wait for every rank that has one
                tie_at[i] = t
                if len(tie_at) < len(tie_ranks):
                    return True
                done = max(tie_at.values()) + cost[key]
                for j, arrived in tie_at.items():
                    times[j].tie_wait += done - arrived
                    if rec:
                        raw.append((j, pc[j], arrived, done))
                    ready[j], now[j] = done, done
                    pc[j] += 1
                tie_at.clear()
                moved = True
                continue
            now[i] = max(t, ready[i])
            pc[i] += 1
            moved = True
        return moved

    while True:
        while any([advance(i) for i in range(n)]):
            pass
        busy = [i for i in range(n) if left[i] > 0.0]
        load: dict[int, float] = {}
        for i in busy:
            load[node[i]] = load.get(node[i], 0.0) + weight[i]
        rate = {i: 1.0 / crowding(load[node[i]], cores, slowdown) for i in busy}
        nxt = [T + left[i] / rate[i] for i in busy]
        nxt += [ready[i] for i in range(n) if ready[i] > T and pc[i] < len(comp.ops[i])]
        nxt += [
            at
            for i in busy
            if filling[i] >= 0 and (at := _awaited(comp, i, pc, arrival)) is not None
        ]
        if not nxt:
            break
        t1 = min(nxt)
        for i in busy:
            left[i] -= (t1 - T) * rate[i]
            w = filling[i]  # the W a piece of runs while the rank waits, or -1
            done = left[i] <= 1e-12 * max(1.0, cost[comp.ops[i][w if w >= 0 else pc[i]][1]])
            if w >= 0:  # a piece of a deferred W ends: its work done, or the data came
                at = _awaited(comp, i, pc, arrival)
                if done or (at is not None and at <= t1):
                    w_left[i][w] = 0.0 if done else left[i]
                    if rec:
                        raw.append((i, w, began[i], t1))
                    times[i].busy += t1 - began[i]
                    left[i], now[i], filling[i] = 0.0, t1, -1
                continue
            if done:
                key = comp.ops[i][pc[i]][1]
                if rec:
                    raw.append((i, pc[i], began[i], t1))
                last_b[i][comp.key_stage[key]] = (began[i], t1)
                times[i].busy += t1 - began[i]
                left[i], now[i] = 0.0, t1
                pc[i] += 1
        T = t1
    return _finish(comp, now, pc, times, raw, actions)


def _awaited(comp: _Compiled, i: int, pc: list[int], arrival: list[float | None]) -> float | None:
    """When the message rank index i waits for at its current receive arrives (None: not
    sent yet)."""
    return arrival[comp.ops[i][pc[i]][2]]


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


def _index_of(ops: list[tuple[int, int, int]], code: int) -> int:
    return next(i for i, op in enumerate(ops) if op[0] == code)


def to_chrome_trace(events: list[Event]) -> list[dict[str, Any]]:
    """Events as Chrome/Perfetto trace events, in ``Runner.chrome_trace``'s format
    (``autopart.runtime.timeline.chrome_event``: the action's fields in ``args``)."""
    return [chrome_event(ev.action, ev.start, ev.end, ev.rank) for ev in events]
