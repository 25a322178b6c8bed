"""Static schedule verifier: run before any schedule executes.

Checks, by simulating every rank's list in lockstep (sends never block, receives wait for
their matching send): every (stage, micro-batch, chunk) runs its forward exactly once and its
backward exactly once, after the forward (in a zero-bubble schedule, where any unit has a ``W``,
every unit runs exactly one ``W``, after its ``B``); every send meets exactly one matching receive on
its peer; and the ranks never all wait at once (no deadlock). Violations raise
``AutopartError`` naming the rank and the action.
"""

from __future__ import annotations

from collections import Counter

from autopart.errors import AutopartError
from autopart.schedule.ir import Action

_MATCH = {"RECV_F": "SEND_F", "RECV_B": "SEND_B"}


def verify(actions: dict[int, list[Action]], units: set[tuple[int, int, int]]) -> None:
    """``actions``: rank → list; ``units``: every (stage, mb, chunk) that must run once each."""
    ran: dict[str, Counter] = {"F": Counter(), "B": Counter(), "W": Counter()}
    for rank, acts in actions.items():
        for a in acts:
            if a.kind in ran:
                unit = (a.stage, a.mb, a.chunk)
                if unit not in units:
                    raise AutopartError(f"rank {rank}: {a} runs a unit outside the plan")
                before = {"B": "F", "W": "B"}.get(a.kind)
                if before and ran[before][unit] == 0:
                    raise AutopartError(
                        f"rank {rank}: {a} runs before its {'forward' if before == 'F' else 'B'}"
                    )
                ran[a.kind][unit] += 1
    # a zero-bubble schedule splits every backward (B, then W), any other none
    kinds = ("F", "B", "W") if ran["W"] else ("F", "B")
    for kind in kinds:
        for unit in sorted(units):
            if ran[kind][unit] != 1:
                where = sorted(
                    {
                        r
                        for r, acts in actions.items()
                        for a in acts
                        if a.kind == kind and (a.stage, a.mb, a.chunk) == unit
                    }
                )
                who = f"rank {where[0]}" if where else "no rank"
                raise AutopartError(
                    f"{who}: {kind}(s{unit[0]},m{unit[1]},c{unit[2]}) runs {ran[kind][unit]} times, "
                    "not once (every stage, micro-batch and chunk needs one forward and one "
                    "backward, and in a zero-bubble schedule one W)"
                )
    _simulate(actions)


def _simulate(actions: dict[int, list[Action]]) -> None:
    pc = dict.fromkeys(actions, 0)
    posted: Counter = Counter()  # (kind, src, dst, stage, mb, chunk) sends not yet received
    while any(pc[r] < len(actions[r]) for r in actions):
        progressed = False
        for r, acts in actions.items():
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if a.kind.startswith("SEND"):
                    if a.peer not in actions:
                        raise AutopartError(
                            f"rank {r}: {a} sends to rank {a.peer}, which has no schedule"
                        )
                    posted[(a.kind, r, a.peer, a.stage, a.mb, a.chunk)] += 1
                elif a.kind in _MATCH:
                    key = (_MATCH[a.kind], a.peer, r, *_sender_unit(a))
                    if posted[key] == 0:
                        break
                    posted[key] -= 1
                pc[r] += 1
                progressed = True
        if not progressed:
            waiting = ", ".join(
                f"rank {r} at step {pc[r]} {actions[r][pc[r]]}"
                for r in actions
                if pc[r] < len(actions[r])
            )
            raise AutopartError(f"schedule deadlocks: every rank waits ({waiting})")
    unmatched = [k for k, v in posted.items() if v]
    if unmatched:
        kind, src, dst, stage, mb, chunk = unmatched[0]
        raise AutopartError(f"rank {src}: {kind}(s{stage},m{mb}) to rank {dst} is never received")


def _sender_unit(recv: Action) -> tuple[int, int, int]:
    """The (stage, mb, chunk) the matching send names: the neighbouring stage's."""
    stage = recv.stage - 1 if recv.kind == "RECV_F" else recv.stage + 1
    return (stage, recv.mb, recv.chunk)
