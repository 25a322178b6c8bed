"""Schedule generators: (pipeline rank, micro-batches m, pipeline peers, dp, v) → actions.

Pipeline rank r of p holds model chunks (stages) r, r + p, …, r + (v−1)·p; ``peers[i]`` is the
global rank at pipeline position i (sends and receives name global ranks). Every generator
orders this rank's forward units and backward units and interleaves them after a warmup:

- ``gpipe``: all forwards, then all backwards (warmup = every forward);
- ``1f1b``: warmup = min(p − r − 1, m) forwards, then one forward / one backward, then drain;
- ``interleaved-1f1b`` (v ≥ 2, m % p == 0): micro-batches in groups of p, forwards through the
  chunks in order and backwards in reverse, warmup = min(2(p − r − 1) + (v − 1)·p, m·v).

With p = 1 every schedule is gradient accumulation ``F(m0) B(m0) F(m1) B(m1) …``. Data-parallel
ranks end with ``DP_REDUCE``; ranks holding a parameter another pipeline rank also holds (tied
embedding / LM head) end with ``TIE_REDUCE``.
"""

from __future__ import annotations

from collections.abc import Callable

from autopart.errors import AutopartError
from autopart.schedule.ir import Action

Unit = tuple[int, int]  # (stage, micro-batch)


def _fwd(stage: int, mb: int, peers: list[int], n_stages: int) -> list[Action]:
    p = len(peers)
    recv = [Action("RECV_F", stage, mb, peer=peers[(stage - 1) % p])] if stage > 0 else []
    send = (
        [Action("SEND_F", stage, mb, peer=peers[(stage + 1) % p])] if stage < n_stages - 1 else []
    )
    return [*recv, Action("F", stage, mb), *send]


def _bwd(stage: int, mb: int, peers: list[int], n_stages: int) -> list[Action]:
    p = len(peers)
    recv = (
        [Action("RECV_B", stage, mb, peer=peers[(stage + 1) % p])] if stage < n_stages - 1 else []
    )
    send = [Action("SEND_B", stage, mb, peer=peers[(stage - 1) % p])] if stage > 0 else []
    return [*recv, Action("B", stage, mb), *send]


def _weave(
    fwd: list[Unit], bwd: list[Unit], warmup: int, peers: list[int], n_stages: int
) -> list[Action]:
    """Warmup forwards, then alternate one forward / one backward, then the remaining backwards."""
    out = [a for s, mb in fwd[:warmup] for a in _fwd(s, mb, peers, n_stages)]
    steady = len(fwd) - warmup
    for i in range(steady):
        out += _fwd(*fwd[warmup + i], peers, n_stages) + _bwd(*bwd[i], peers, n_stages)
    return out + [a for s, mb in bwd[steady:] for a in _bwd(s, mb, peers, n_stages)]


def gpipe(r: int, m: int, peers: list[int], v: int) -> list[Action]:
    p = len(peers)
    if p == 1:
        return one_f_one_b(r, m, peers, v)
    units = [(r, mb) for mb in range(m)]
    return _weave(units, units, len(units), peers, p)


def one_f_one_b(r: int, m: int, peers: list[int], v: int) -> list[Action]:
    p = len(peers)
    units = [(r, mb) for mb in range(m)]
    return _weave(units, units, min(p - r - 1, m), peers, p)


def interleaved(r: int, m: int, peers: list[int], v: int) -> list[Action]:
    p = len(peers)
    groups = [range(g, g + p) for g in range(0, m, p)]
    fwd = [(c * p + r, mb) for g in groups for c in range(v) for mb in g]
    bwd = [(c * p + r, mb) for g in groups for c in reversed(range(v)) for mb in g]
    warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v)
    return _weave(fwd, bwd, warmup, peers, p * v)


GENERATORS: dict[str, Callable[[int, int, list[int], int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved,
}


def generate(
    name: str, r: int, m: int, peers: list[int], dp: int = 1, v: int = 1, tied: bool = False
) -> list[Action]:
    """The action list of pipeline rank ``r`` for schedule ``name``."""
    if name not in GENERATORS:
        raise AutopartError(f"schedule {name!r} has no generator in this version",
                            hint=f"available: {', '.join(GENERATORS)}")  # fmt: skip
    if (v > 1) != (name == "interleaved-1f1b"):
        raise AutopartError(f"schedule {name} with virtual_stages={v}",
                            hint="virtual stages > 1 need interleaved-1f1b, and interleaved-1f1b needs them")  # fmt: skip
    if name == "interleaved-1f1b" and m % len(peers):
        raise AutopartError(f"interleaved-1f1b needs micro-batches ({m}) divisible by pp ({len(peers)})",
                            hint=f"use {m + len(peers) - m % len(peers)} micro-batches, or 1f1b")  # fmt: skip
    out = GENERATORS[name](r, m, peers, v)
    out += [Action("DP_REDUCE", r)] if dp > 1 else []
    return out + ([Action("TIE_REDUCE", r)] if tied else [])
