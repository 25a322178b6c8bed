"""Schedule generators: (pipeline rank, micro-batches m, pipeline peers, dp, v) → actions.

Pipeline rank r of p holds model chunks (stages) r, r + p, …, r + (v−1)·p; ``peers[i]`` is the
global rank at pipeline position i (sends and receives name global ranks). Every generator
orders this rank's forward units and backward units and interleaves them after a warmup:

- ``gpipe``: all forwards, then all backwards (warmup = every forward);
- ``1f1b``: warmup = min(p − r − 1, m) forwards, then one forward / one backward, then drain;
- ``interleaved-1f1b`` (v ≥ 2, m % p == 0): micro-batches in groups of p, forwards through the
  chunks in order and backwards in reverse, warmup = min(2(p − r − 1) + (v − 1)·p, m·v).

- ``zb-h1`` (zero bubble, Qi et al. 2024, the schedule of 1F1B's memory): 1F1B with each
  backward split into ``B`` (input gradient, on the critical path) and ``W`` (weight gradient),
  ``W`` deferred on rank r by r backwards: the later ranks, which start their backwards first,
  hold weight gradients back to fill their drain, so the input gradients run down the pipeline
  without waiting for them. Every rank then holds at most p units (1F1B's peak, on rank 0), and
  with F, B and W of equal cost the bubble is (p − 1)(F + B − W) against 1F1B's
  (p − 1)(F + B + W), a third;
- ``seq1f1b-zb``: Seq1F1B's (micro-batch, chunk) units, deferred the same way.

With p = 1 every schedule is gradient accumulation ``F(m0) B(m0) F(m1) B(m1) …``. Data-parallel
ranks end with ``DP_REDUCE``; ranks holding a parameter another pipeline rank also holds (tied
embedding / LM head) end with ``TIE_REDUCE``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopart.errors import AutopartError
from autopart.schedule.ir import Action

Unit = tuple[int, int, int]  # (stage, micro-batch, sequence chunk)


def _fwd(stage: int, mb: int, chunk: int, peers: list[int], n_stages: int) -> list[Action]:
    p = len(peers)
    recv = [Action("RECV_F", stage, mb, chunk, peers[(stage - 1) % p])] if stage > 0 else []
    last = stage == n_stages - 1
    send = [] if last else [Action("SEND_F", stage, mb, chunk, peers[(stage + 1) % p])]
    return [*recv, Action("F", stage, mb, chunk), *send]


def _bwd(stage: int, mb: int, chunk: int, peers: list[int], n_stages: int) -> list[Action]:
    p = len(peers)
    last = stage == n_stages - 1
    recv = [] if last else [Action("RECV_B", stage, mb, chunk, peers[(stage + 1) % p])]
    send = [Action("SEND_B", stage, mb, chunk, peers[(stage - 1) % p])] if stage > 0 else []
    return [*recv, Action("B", stage, mb, chunk), *send]


def _weave(
    fwd: list[Unit], bwd: list[Unit], warmup: int, peers: list[int], n_stages: int
) -> list[Action]:
    """Warmup forwards, then alternate one forward / one backward, then the remaining backwards."""
    out = [a for u in fwd[:warmup] for a in _fwd(*u, peers, n_stages)]
    steady = len(fwd) - warmup
    for i in range(steady):
        out += _fwd(*fwd[warmup + i], peers, n_stages) + _bwd(*bwd[i], peers, n_stages)
    return out + [a for u in bwd[steady:] for a in _bwd(*u, peers, n_stages)]


def _weave_zb(
    fwd: list[Unit], bwd: list[Unit], warmup: int, lag: int, peers: list[int], n_stages: int
) -> list[Action]:
    """``_weave`` with split backwards: a unit's ``W`` runs once ``lag`` later ``B``s have run;
    in the drain one ``W`` follows each ``B`` (it fills the wait for the next gradient), and
    the remaining ones end the list."""
    out = [a for u in fwd[:warmup] for a in _fwd(*u, peers, n_stages)]
    pending: list[Unit] = []
    steady = len(fwd) - warmup
    for i, u in enumerate(bwd):
        if i < steady:
            out += _fwd(*fwd[warmup + i], peers, n_stages)
        out += _bwd(*u, peers, n_stages)
        pending.append(u)
        if len(pending) > lag or (i >= steady and pending):
            out.append(Action("W", *pending.pop(0)))
    return out + [Action("W", *u) for u in pending]


def zb_h1(r: int, m: int, peers: list[int], v: int, k: int = 1) -> list[Action]:
    p = len(peers)
    units = [(r, mb, 0) for mb in range(m)]
    warmup = min(p - r - 1, m)
    return _weave_zb(units, units, warmup, r, peers, p)


def seq1f1b_zb(r: int, m: int, peers: list[int], v: int, k: int = 1) -> list[Action]:
    p = len(peers)
    fwd = [(r, mb, c) for mb in range(m) for c in range(k)]
    bwd = [(r, mb, c) for mb in range(m) for c in reversed(range(k))]
    return _weave_zb(fwd, bwd, min(p - r - 1 + k - 1, m * k), r, peers, p)


def gpipe(r: int, m: int, peers: list[int], v: int, k: int = 1) -> list[Action]:
    p = len(peers)
    if p == 1:
        return one_f_one_b(r, m, peers, v)
    units = [(r, mb, 0) for mb in range(m)]
    return _weave(units, units, len(units), peers, p)


def one_f_one_b(r: int, m: int, peers: list[int], v: int, k: int = 1) -> list[Action]:
    p = len(peers)
    units = [(r, mb, 0) for mb in range(m)]
    return _weave(units, units, min(p - r - 1, m), peers, p)


def interleaved(r: int, m: int, peers: list[int], v: int, k: int = 1) -> list[Action]:
    p = len(peers)
    groups = [range(g, g + p) for g in range(0, m, p)]
    fwd = [(c * p + r, mb, 0) for g in groups for c in range(v) for mb in g]
    bwd = [(c * p + r, mb, 0) for g in groups for c in reversed(range(v)) for mb in g]
    warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v)
    return _weave(fwd, bwd, warmup, peers, p * v)


def seq1f1b(r: int, m: int, peers: list[int], v: int, k: int = 1) -> list[Action]:
    """(micro-batch, chunk) units: forwards in chunk order, backwards in reverse chunk order within
    a micro-batch (a chunk's backward needs the later chunks' gradients on its K/V), oldest
    micro-batch first; warmup = min(p − r − 1 + k − 1, m·k)."""
    p = len(peers)
    fwd = [(r, mb, c) for mb in range(m) for c in range(k)]
    bwd = [(r, mb, c) for mb in range(m) for c in reversed(range(k))]
    return _weave(fwd, bwd, min(p - r - 1 + k - 1, m * k), peers, p)


def seq1f1b_interleaved(r: int, m: int, peers: list[int], v: int, k: int = 1) -> list[Action]:
    """Seq1F1B over p·v model chunks: interleaved 1F1B whose units are (micro-batch, chunk)."""
    p = len(peers)
    groups = [range(g, g + p) for g in range(0, m, p)]
    fwd = [(c * p + r, mb, j) for g in groups for c in range(v) for mb in g for j in range(k)]
    bwd = [
        (c * p + r, mb, j)
        for g in groups
        for c in reversed(range(v))
        for mb in g
        for j in reversed(range(k))
    ]
    warmup = min(2 * (p - r - 1) + (v - 1) * p * k + (k - 1), m * v * k)
    return _weave(fwd, bwd, warmup, peers, p * v)


# (rank, micro-batches, the pipeline's ranks, virtual stages, sequence chunks) → actions
GENERATORS: dict[str, Callable[[int, int, list[int], int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved,
    "seq1f1b": seq1f1b,
    "seq1f1b-interleaved": seq1f1b_interleaved,
    "zb-h1": zb_h1,
    "seq1f1b-zb": seq1f1b_zb,
}


@dataclass(frozen=True)
class Traits:
    """What a schedule is, as data (read through ``Plan``'s properties, never from its name):

    - ``interleaved``: several virtual stages per pipeline rank;
    - ``chunked``: micro-batches cut into Seq1F1B sequence chunks (K/V prefixes handed over);
    - ``split_backward``: the backward split into B and W (``passes/weight_grad_split.py``
      defers the weight gradients of the parameter GEMMs to W)."""

    interleaved: bool = False
    chunked: bool = False
    split_backward: bool = False


TRAITS: dict[str, Traits] = {  # a registry built at import: one entry per generator
    "gpipe": Traits(),
    "1f1b": Traits(),
    "interleaved-1f1b": Traits(interleaved=True),
    "seq1f1b": Traits(chunked=True),
    "seq1f1b-interleaved": Traits(interleaved=True, chunked=True),
    "zb-h1": Traits(split_backward=True),
    "seq1f1b-zb": Traits(chunked=True, split_backward=True),
}
SPLIT_BACKWARD = tuple(n for n, t in TRAITS.items() if t.split_backward)


def traits(name: str) -> Traits:
    """The traits of schedule ``name`` (a name without a generator has none)."""
    return TRAITS.get(name, Traits())


def check_schedule(name: str, pp: int, m: int, v: int = 1, k: int = 1) -> None:
    """The schedule rules, in one place (``Plan`` calls this on construction): a known
    schedule; virtual stages exactly with an interleaved one, which needs pp ≥ 2 and
    micro-batches a multiple of pp; sequence chunks only with Seq1F1B."""
    if name not in GENERATORS:
        raise AutopartError(
            f"schedule {name!r} has no generator in this version",
            hint=f"available: {', '.join(GENERATORS)}",
        )
    t = traits(name)
    if k > 1 and not t.chunked:
        raise AutopartError(
            f"seq_chunks={k} needs a Seq1F1B schedule, not {name}",
            hint="use schedule='seq1f1b' (or 'seq1f1b-interleaved' with virtual stages)",
        )
    if (v > 1) != t.interleaved:
        raise AutopartError(
            f"schedule {name} with virtual_stages={v}",
            hint="virtual stages > 1 need an interleaved schedule, and it needs them",
        )
    if t.interleaved and pp < 2:  # its virtual stages would send to their own rank
        raise AutopartError(
            f"{name} needs pipeline parallelism (pp ≥ 2): with pp=1 every virtual stage is "
            "on one rank, and the stages would send activations to themselves",
            hint="use pp ≥ 2, or 1f1b (seq1f1b) without virtual stages",
        )
    if t.interleaved and m % pp:
        raise AutopartError(
            f"{name} needs micro-batches divisible by pp: {m} % {pp} = {m % pp}",
            hint=f"use {m + pp - m % pp} micro-batches, or 1f1b",
        )


def generate(
    name: str,
    r: int,
    m: int,
    peers: list[int],
    dp: int = 1,
    v: int = 1,
    tied: bool = False,
    k: int = 1,
) -> list[Action]:
    """The action list of pipeline rank ``r`` for schedule ``name``, for arguments that pass
    ``check_schedule`` (as a ``Plan``'s always do)."""
    if name not in GENERATORS:
        check_schedule(name, len(peers), m, v, k)  # says which schedules there are
    out = GENERATORS[name](r, m, peers, v, k)
    out += [Action("DP_REDUCE", r)] if dp > 1 else []
    return out + ([Action("TIE_REDUCE", r)] if tied else [])
