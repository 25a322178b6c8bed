"""pipeline_split: stages cover every node once, cuts balance cost, the split graph is the model."""

from __future__ import annotations

import itertools

import nanogpt
import pytest
import torch
from conftest import Case, feed, rel_err, run_graph
from hypothesis import given, settings
from hypothesis import strategies as st

from autopart.errors import AutopartError
from autopart.frontend.capture import capture
from autopart.graph import copy_graph
from autopart.layout import Mesh, Plan
from autopart.lowering import compile_program
from autopart.lowering.pass_runner import run_passes
from autopart.meta import META_INPUT, META_INPUTS
from autopart.passes import PIPELINE
from autopart.passes.pipeline_split import (
    balanced_cuts,
    equal_block_cuts,
    imbalance,
    pipeline_split,
    recomputable,
    stage_costs,
    stage_graphs,
)


def _split(case: Case, pp: int = 2, v: int = 1, m: int = 2):
    schedule = "interleaved-1f1b" if v > 1 else "1f1b"
    plan = Plan(Mesh(pp=pp), schedule, microbatches=m, virtual_stages=v)
    gm, _ = run_passes(copy_graph(case.captured.graph), plan, PIPELINE)
    return gm


@pytest.fixture(scope="module")
def deep() -> Case:
    model, batch = nanogpt.make_deep()
    model = model.double()
    return Case(model, batch, capture(model, batch))


# -- the cut search -------------------------------------------------------------------------


def _brute(cost: list[float], stages: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(cost)), stages - 1):
        best = min(best, max(stage_costs(cost, list(cuts))))
    return best


@settings(max_examples=60, deadline=None, database=None)
@given(cost=st.lists(st.floats(0.1, 10.0), min_size=3, max_size=9), data=st.data())
def test_balanced_cuts_are_optimal_and_contiguous(cost: list[float], data) -> None:
    stages = data.draw(st.integers(1, len(cost)))
    cuts = balanced_cuts(cost, stages)
    assert len(cuts) == stages - 1 and cuts == sorted(set(cuts))
    assert all(0 < c < len(cost) for c in cuts)  # every stage non-empty
    assert max(stage_costs(cost, cuts)) == pytest.approx(_brute(cost, stages))


def test_thirty_blocks_on_four_stages_drops_nothing() -> None:
    cost = [1.0] + [5.0] * 30 + [12.0]  # embedding, 30 blocks, heavy head
    cuts = balanced_cuts(cost, 4)
    per = stage_costs(cost, cuts)
    assert len(per) == 4 and sum(per) == sum(cost)
    assert imbalance(per) < imbalance(stage_costs(cost, equal_block_cuts(len(cost), 4)))


def test_heavy_head_is_balanced_where_equal_blocks_are_not() -> None:
    """Large vocabulary, few blocks: max/mean ≤ 1.10 by the cost model, worse by block count."""
    model, batch = nanogpt.make(vocab_size=2048, n_layer=4, n_embd=64)
    program = compile_program(capture(model, batch), Plan(Mesh(pp=2), microbatches=2))
    cost, cuts = program.split["unit_costs"], program.split["cuts"]
    auto = imbalance(stage_costs(cost, cuts))
    equal = imbalance(stage_costs(cost, equal_block_cuts(len(cost), 2)))
    assert auto <= 1.10 < equal, (auto, equal)


# -- the stage graphs -----------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "v"), [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_split_graph_equals_the_model(deep: Case, pp: int, v: int) -> None:
    gm = _split(deep, pp, v, m=pp)
    stages = stage_graphs(gm)
    assert len(stages) == pp * v
    params = {f: t.detach().clone().requires_grad_(True) for f, t in deep.captured.params.items()}
    (loss,) = gm(*feed(deep.captured, deep.batch, params))
    loss.backward()
    ref_loss, ref_grads = run_graph(deep.captured, deep.batch)
    assert rel_err(loss.detach(), ref_loss) <= 1e-12
    for f, p in params.items():
        assert rel_err(p.grad, ref_grads[f]) <= 1e-12, f


def test_every_node_in_exactly_one_stage(deep: Case) -> None:
    plan = Plan(Mesh(pp=4), microbatches=4)
    before, _ = run_passes(
        copy_graph(deep.captured.graph), plan, PIPELINE[: PIPELINE.index(pipeline_split)]
    )
    gm = pipeline_split(copy_graph(before), plan)
    rec = recomputable(before)
    want = sorted(n.name for n in before.graph.nodes if n.op == "call_function" and n not in rec)
    got = [n.name for st in stage_graphs(gm) for n in st.graph.nodes if n.op == "call_function"]
    assert sorted(set(got) - {n.name for n in rec}) == want
    shared = [x for x in got if x not in {n.name for n in rec}]
    assert len(shared) == len(set(shared))  # no activation computed twice


def test_neighbours_hand_over_exactly_what_the_next_stage_reads(deep: Case) -> None:
    stages = stage_graphs(_split(deep, 4))
    for k, stage in enumerate(stages):
        refs = stage.meta[META_INPUTS]
        acts = [r for r in refs if r.kind == "act"]
        assert [int(r.name) for r in acts] == list(range(len(acts)))
        if k == 0:
            assert not acts
        else:
            out = next(n for n in stages[k - 1].graph.nodes if n.op == "output").args[0]
            assert len(out) == len(acts) > 0
        kinds = {n.meta[META_INPUT].kind for n in stage.graph.nodes if n.op == "placeholder"}
        assert kinds <= {"param", "data", "act", "buffer", "constant", "rank", "rng"}


def test_positions_and_masks_are_recomputed_not_sent(gpt_manual: Case) -> None:
    stages = stage_graphs(_split(gpt_manual, 2))
    second = stages[1]
    assert any(n.target == torch.ops.aten.sym_size.int for n in second.graph.nodes)
    sent = next(n for n in stages[0].graph.nodes if n.op == "output").args[0]
    assert all(n.meta["val"].is_floating_point() for n in sent)  # only activations cross


def test_tied_embedding_is_held_by_both_ends(hf_gpt: Case) -> None:
    program = compile_program(hf_gpt.captured, Plan(Mesh(pp=2), microbatches=2))
    first, last = program.rank(0), program.rank(1)
    assert first.ties == last.ties == {"transformer.wte.weight": [0, 1]}
    assert first.actions[-1].kind == last.actions[-1].kind == "TIE_REDUCE"
    assert "transformer.h.0.attn.c_attn.weight" in first.shards
    assert "transformer.h.0.attn.c_attn.weight" not in last.shards


def test_more_stages_than_blocks_is_refused(gpt_sdpa: Case) -> None:
    with pytest.raises(AutopartError) as err:
        _split(gpt_sdpa, pp=4)
    assert "4 stages, but the model has 2 transformer blocks" in err.value.message
    assert "lower pp or virtual_stages" in err.value.hint


class _Shared(torch.nn.Module):
    """One block applied three times (ALBERT's shared weights): no module has a layer index."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)
        self.norm, self.fc = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for _ in range(3):
            x = x + torch.tanh(self.fc(self.norm(x)))
        return self.head(x)


def test_a_model_with_no_blocks_to_cut_between_is_refused_saying_why() -> None:
    """It was refused as "the model has 0 transformer blocks" with the hint to lower pp
    (the eighteenth session's model probe): the message now says what the pipeline cuts
    between and why this model has none."""
    ids = torch.randint(0, 50, (2, 12))
    captured = capture(_Shared().double(), (ids, ids))
    with pytest.raises(AutopartError) as err:
        compile_program(captured, Plan(Mesh(pp=2)))
    assert "no transformer blocks to cut between" in err.value.message
    assert "one block applied several times" in err.value.message
    assert "nn.ModuleList" in err.value.hint


def test_memory_limit_moves_the_cut() -> None:
    cost = [1.0, 4.0, 4.0, 4.0, 4.0, 1.0]
    memory = [(0.0, 0.0), (10.0, 1.0), (10.0, 1.0), (10.0, 1.0), (100.0, 1.0), (0.0, 0.0)]
    assert balanced_cuts(cost, 2) == [3]  # compute alone: embed,b0,b1 | b2,b3,head
    # 4 × params + activations: the big block b3 forces the cut later so stage 1 holds less
    cut = balanced_cuts(cost, 2, memory, limit=420.0, inflight=[2, 1])  # b2+b3 need 442
    assert cut == [4]
    with pytest.raises(AutopartError) as err:
        balanced_cuts(cost, 2, memory, limit=100.0, inflight=[2, 1])
    assert "no split of the model into 2 stages fits" in err.value.message
    assert "raise the memory limit" in err.value.hint


def test_more_stages_than_units_is_refused() -> None:
    # without a memory limit the refusal names the units (it read the limit, None, before)
    with pytest.raises(AutopartError) as err:
        balanced_cuts([1.0, 1.0], 3)
    assert "2 units cannot be cut into 3 non-empty stages" in err.value.message


def test_memory_limit_from_the_plan(gpt_sdpa: Case) -> None:
    ok = Plan(Mesh(pp=2), microbatches=2, max_stage_memory_gb=1.0)
    run_passes(copy_graph(gpt_sdpa.captured.graph), ok, PIPELINE)
    tight = Plan(Mesh(pp=2), microbatches=2, max_stage_memory_gb=1e-6)
    with pytest.raises(AutopartError, match="fits 1e-06 GiB per stage"):
        run_passes(copy_graph(gpt_sdpa.captured.graph), tight, PIPELINE)


class _Looped(torch.nn.Module):
    """Four blocks applied as 0, 1, 2, 3, then 0 again (a model that loops over its blocks, as
    HRM does): the graph is not a chain of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for i in (0, 1, 2, 3, 0):
            x = x + torch.tanh(self.layers[i](x))
        return self.head(x)


def test_blocks_run_out_of_order_are_refused_by_name() -> None:
    """A block whose input comes from a later block cannot sit in an earlier stage: the plan is
    refused naming the node, its module and why, before any rank starts."""
    ids = torch.randint(0, 50, (2, 8))
    captured = capture(_Looped(), (ids, ids))
    with pytest.raises(AutopartError) as err:
        compile_program(captured, Plan(Mesh(pp=2), microbatches=2))
    message = err.value.message
    assert "would need node" in message and "(layers.0)" in message
    assert "does not run its blocks once each, in order" in message
    assert "no pp" in err.value.hint


class _TwoLists(torch.nn.Module):
    """Projections in an indexed list run before the blocks (Gemma 3n's ``altup_projections.N``
    beside ``layers.N``), ``torch.multiply`` and ``torch.where`` with a scalar in each block."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)
        self.pre = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = self.pre[0](x) + self.pre[1](x)
        for layer in self.layers:
            y = torch.multiply(torch.tanh(layer(x)), 0.5)
            x = x + torch.where(y > 0, y, 0.1)
        return self.head(x)


@pytest.mark.multirank
def test_only_the_list_of_blocks_numbers_blocks() -> None:
    """With two indexed lists, the blocks are the one with the most nodes: the projections'
    nodes belong to no block (as ``pre.1``, block 1, they ran before block 0, and the split was
    refused: "does not run its blocks once each"). pp=2 1F1B and Seq1F1B on gloo ranks match
    one device."""
    from autopart.meta import META_LAYER, META_MODULE
    from autopart.parity.verify import Check, verify_many

    def make():
        torch.manual_seed(0)
        ids, labels = torch.randint(0, 50, (2, 4, 16))
        return _TwoLists(), (ids, labels)

    model, batch = make()
    graph = capture(model, batch).graph
    layers = {n.meta[META_MODULE]: n.meta[META_LAYER] for n in graph.graph.nodes}
    assert layers["pre.1"] is None and layers["layers.1"] == 1 and layers["layers.3"] == 3
    checks = {
        "1f1b": Check(make, pp=2, microbatches=2),
        "seq1f1b": Check(make, pp=2, microbatches=2, schedule="seq1f1b", seq_chunks=2),
    }
    for name, report in verify_many(checks, via="fork", timeout_s=90).items():
        assert not isinstance(report, Exception) and report.ok, (name, str(report))
