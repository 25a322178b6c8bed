"""Schedule generators: (stages p, micro-batches m, this pipeline rank) → list of actions.

Pipeline ranks are numbered 0..p-1 along the pipeline; ``peers[i]`` is the global rank that
runs stage i of this pipeline (sends and receives name global ranks). With p = 1 every schedule
is the same gradient-accumulation loop: ``F(m0) B(m0) F(m1) B(m1) …`` then ``DP_REDUCE``.
"""

from __future__ import annotations

from collections.abc import Callable

from autopart.errors import AutopartError
from autopart.schedule.ir import Action


def _fwd(stage: int, mb: int, peers: list[int]) -> list[Action]:
    p = len(peers)
    recv = [Action("RECV_F", stage, mb, peer=peers[stage - 1])] if stage > 0 else []
    send = [Action("SEND_F", stage, mb, peer=peers[stage + 1])] if stage < p - 1 else []
    return [*recv, Action("F", stage, mb), *send]


def _bwd(stage: int, mb: int, peers: list[int]) -> list[Action]:
    p = len(peers)
    recv = [Action("RECV_B", stage, mb, peer=peers[stage + 1])] if stage < p - 1 else []
    send = [Action("SEND_B", stage, mb, peer=peers[stage - 1])] if stage > 0 else []
    return [*recv, Action("B", stage, mb), *send]


def gpipe(stage: int, m: int, peers: list[int], dp: int) -> list[Action]:
    """All forwards, then all backwards (in micro-batch order)."""
    if len(peers) == 1:  # p = 1: accumulate one micro-batch at a time (activations freed early)
        return one_f_one_b(stage, m, peers, dp)
    out = [a for mb in range(m) for a in _fwd(stage, mb, peers)]
    out += [a for mb in range(m) for a in _bwd(stage, mb, peers)]
    return out + ([Action("DP_REDUCE", stage)] if dp > 1 else [])


def one_f_one_b(stage: int, m: int, peers: list[int], dp: int) -> list[Action]:
    """1F1B: warmup = min(p − r − 1, m) forwards, then alternate, then drain backwards."""
    warmup = min(len(peers) - stage - 1, m)
    out = [a for mb in range(warmup) for a in _fwd(stage, mb, peers)]
    for i in range(m - warmup):
        out += _fwd(stage, warmup + i, peers) + _bwd(stage, i, peers)
    out += [a for mb in range(m - warmup, m) for a in _bwd(stage, mb, peers)]
    return out + ([Action("DP_REDUCE", stage)] if dp > 1 else [])


GENERATORS: dict[str, Callable[[int, int, list[int], int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def generate(name: str, stage: int, m: int, peers: list[int], dp: int = 1) -> list[Action]:
    """The action list of pipeline rank ``stage`` for schedule ``name``."""
    if name not in GENERATORS:
        raise AutopartError(
            f"schedule {name!r} has no generator in this version",
            hint=f"available: {', '.join(GENERATORS)}",
        )
    return GENERATORS[name](stage, m, peers, dp)
