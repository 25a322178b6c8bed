"""data_parallel: every parameter placeholder gets its gradient bucket (the pass invariant)."""

from __future__ import annotations

import pytest
from conftest import Case
from torch import fx

from autopart.graph import copy_graph
from autopart.layout import Mesh, Plan
from autopart.lowering.pass_runner import run_passes
from autopart.meta import META_BUCKET, META_INPUT, META_PASSES
from autopart.passes import PIPELINE
from autopart.passes.data_parallel import buckets, data_parallel

PASS_NAMES = [p.__name__ for p in PIPELINE]

MiB = 2**20


def _params(gm: fx.GraphModule) -> list[fx.Node]:
    return [
        n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[META_INPUT].kind == "param"
    ]


def _nbytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


def _first_use(gm: fx.GraphModule) -> dict[str, int]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return {p.meta[META_INPUT].name: min(order[u] for u in p.users) for p in _params(gm)}


def _run(case: Case, **plan) -> fx.GraphModule:
    return data_parallel(copy_graph(case.captured.graph), Plan(**plan))


def test_every_param_gets_a_bucket(case: Case) -> None:
    gm = _run(case, mesh=Mesh(dp=2))
    params = _params(gm)
    assert len(params) == len(case.captured.params)
    for p in params:
        assert isinstance(p.meta.get(META_BUCKET), int), p.name
    for n in gm.graph.nodes:  # only parameters are bucketed
        if n.op == "placeholder" and n.meta[META_INPUT].kind != "param":
            assert n.meta.get(META_BUCKET) is None
    # the pass annotates a copy: the shared capture is left alone
    assert all(META_BUCKET not in p.meta for p in case.captured.placeholders("param"))


def test_a_parameter_the_graph_never_reads_gets_no_bucket() -> None:
    """Its gradient stays None, as on one device (a zero one would take AdamW's decay); every
    parameter the graph reads still gets a bucket."""
    import torch

    from autopart.frontend.capture import capture
    from autopart.models import nanogpt

    model, (ids, labels) = nanogpt.make(n_layer=2, n_embd=8, n_head=2, block_size=16)
    model.unused = torch.nn.Linear(4, 4)
    gm = data_parallel(copy_graph(capture(model, (ids, labels)).graph), Plan(Mesh(dp=2)))
    unread = {p.meta[META_INPUT].name for p in _params(gm) if not p.users}
    assert unread == {"unused.weight", "unused.bias"}
    for p in _params(gm):
        assert (p.meta[META_BUCKET] is None) == (p.meta[META_INPUT].name in unread), p.name
    assert not unread & {f for b in buckets(gm) for f in b}


def test_default_bucket_holds_the_whole_small_model(gpt_sdpa: Case) -> None:
    gm = _run(gpt_sdpa, mesh=Mesh(dp=2))  # 25 MiB ≫ this model
    assert {p.meta[META_BUCKET] for p in _params(gm)} == {0}
    assert buckets(gm) == [list(gpt_sdpa.captured.params)]


def test_buckets_follow_reverse_first_use(case: Case) -> None:
    gm = _run(case, mesh=Mesh(dp=2), bucket_mb=0.01)
    first = _first_use(gm)
    bucket = {p.meta[META_INPUT].name: p.meta[META_BUCKET] for p in _params(gm)}
    # a parameter first used later has its gradient ready earlier: a lower (or equal) bucket
    for a in first:
        for b in first:
            if first[a] > first[b]:
                assert bucket[a] <= bucket[b], (a, b)
    last = max(first, key=first.get)
    assert bucket[last] == 0
    assert bucket["transformer.wte.weight"] == max(bucket.values())  # the embedding: used first
    assert bucket["transformer.ln_f.weight"] == 0  # the final norm; lm_head reuses wte
    assert len(set(bucket.values())) > 1


@pytest.mark.parametrize("bucket_mb", [0.002, 0.01, 0.05])
def test_small_buckets_respect_the_limit(gpt_sdpa: Case, bucket_mb: float) -> None:
    gm = _run(gpt_sdpa, mesh=Mesh(dp=2), bucket_mb=bucket_mb)
    limit = bucket_mb * MiB
    by_name = {p.meta[META_INPUT].name: p for p in _params(gm)}
    listed = buckets(gm)
    assert len(listed) > 1
    assert [sorted(b) for b in listed] == [
        sorted(f for f, p in by_name.items() if p.meta[META_BUCKET] == i)
        for i in range(len(listed))
    ]  # buckets are numbered 0..n-1 with none empty
    for names in listed:
        size = sum(_nbytes(by_name[f]) for f in names)
        assert size <= limit or len(names) == 1, (names, size, limit)
    # greedy: a bucket is closed only when the next gradient would not fit
    ready = sorted(by_name, key=lambda f: -_first_use(gm)[f])
    for i in range(len(listed) - 1):
        size = sum(_nbytes(by_name[f]) for f in listed[i])
        nxt = next(f for f in ready if by_name[f].meta[META_BUCKET] == i + 1)
        assert size + _nbytes(by_name[nxt]) > limit


def test_buckets_list_each_param_once(case: Case) -> None:
    gm = _run(case, mesh=Mesh(dp=4), bucket_mb=0.005)
    flat = [f for b in buckets(gm) for f in b]
    assert sorted(flat) == sorted(case.captured.params)
    assert len(flat) == len(set(flat))
    assert all(b for b in buckets(gm))


def test_dp1_buckets_nothing(case: Case) -> None:
    gm = _run(case, mesh=Mesh(dp=1), bucket_mb=0.001)
    params = _params(gm)
    assert params and all(META_BUCKET in p.meta and p.meta[META_BUCKET] is None for p in params)
    assert buckets(gm) == []


def test_pass_runs_in_the_pipeline(gpt_sdpa: Case) -> None:
    assert data_parallel in PIPELINE
    gm, history = run_passes(copy_graph(gpt_sdpa.captured.graph), Plan(Mesh(dp=2)), PIPELINE)
    assert [h.name for h in history] == ["capture", *PASS_NAMES]
    assert gm.meta[META_PASSES] == PASS_NAMES
    assert all(isinstance(p.meta[META_BUCKET], int) for p in _params(gm))
