"""Shared cores (benchmarks/shared_cores.py): CPU ranks taking turns on fewer cores, as the
simulator's speed model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopart.layout import Plan
from autopart.planning.cluster import PRESETS
from autopart.planning.simulate import GPTShape, simulate, simulate_actions
from autopart.schedule import Action, generate

from shared_cores import SharedCores

A100 = PRESETS["dgx-a100-80gb"]


def pipeline(name: str, p: int, m: int, k: int = 1) -> dict[int, list[Action]]:
    return {r: generate(name, r, m, list(range(p)), k=k) for r in range(p)}


def work(a: Action) -> float:
    return {"F": 1.0, "B": 2.0}.get(a.kind, 0.0)


@pytest.mark.parametrize(
    "name,p,m,k", [("1f1b", 4, 6, 1), ("gpipe", 3, 4, 1), ("seq1f1b", 4, 4, 3)]
)
def test_a_core_for_every_rank_is_the_dedicated_simulation(name, p, m, k) -> None:
    acts = pipeline(name, p, m, k)
    plain = simulate_actions(acts, work, lambda a: 0.2)
    shared = simulate_actions(acts, work, lambda a: 0.2, speed=SharedCores(p))
    assert [(e.rank, e.action, e.start, e.end) for e in shared.events] == [
        (e.rank, e.action, e.start, e.end) for e in plain.events
    ]


@pytest.mark.parametrize("name,k", [("1f1b", 1), ("gpipe", 1), ("seq1f1b", 2)])
def test_one_shared_core_is_never_idle_while_work_is_left(name: str, k: int) -> None:
    """With free transfers a waiting rank leaves the core to the others: one core runs all the
    ranks' work back to back, so the iteration lasts exactly the sum of it."""
    acts = pipeline(name, 3, 4, k=k)
    tl = simulate_actions(acts, work, speed=SharedCores(1))
    assert tl.span == pytest.approx(3 * 4 * k * 3.0)
    # two cores for three ranks: between the one-core sum / 2 and the unshared pipeline
    two = simulate_actions(acts, work, speed=SharedCores(2)).span
    alone = simulate_actions(acts, work).span
    assert 3 * 4 * k * 3.0 / 2 <= two <= alone * 3 / 2 and two > alone


def test_shared_cores_slow_data_parallel_ranks_by_ranks_over_cores() -> None:
    shape = GPTShape(layers=4, hidden=256, heads=8, seq=256, vocab=512)
    cpu = replace(A100, gpus_per_node=4)
    plan = Plan.from_batch(8, micro_batch=1, dp=4)

    def busy(cores: float, slowdown: float = 0.0, cluster=cpu, plan=plan) -> float:
        return (
            simulate(shape, cluster, plan, speed=SharedCores(cores, slowdown))
            .timeline.ranks[0]
            .busy
        )

    alone = simulate(shape, cpu, plan).timeline.ranks[0].busy
    assert busy(2) == pytest.approx(2 * alone)
    # sharing the node costs the slowdown more, with cores enough for all ranks too (memory
    # bandwidth, caches), on top of the share while they outnumber the cores
    assert busy(2, 0.25) == pytest.approx(2 * 1.25 * alone)
    assert busy(4, 0.25) == pytest.approx(1.25 * alone)
    one = replace(cpu, gpus_per_node=1)
    single = Plan.from_batch(8, micro_batch=1)  # one process alone on its node: never slowed
    assert busy(1, 0.25, one, single) == pytest.approx(busy(1, 0.0, one, single))
