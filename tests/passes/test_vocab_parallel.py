"""vocab_parallel: after the PIPELINE at tp=2 the vocabulary is split, never gathered — one
``autopart::vocab_parallel_ce`` on [N, V/tp] logits, the embedding table and LM head cut into
V/tp rows, a ``tp_rank`` input; plus the op's own numerics in one process (tp world 1)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import Case
from torch import fx
from tp_models import (
    MODELS,
    aten,
    calls,
    compiled,
    descendants,
    hidden_size,
    input_ids_val,
    llama_case,
    model_case,
    ops,
    params,
    placeholders,
    solo_tp,
    sym,
    through_views,
)

from autopart import AutopartError, collectives
from autopart.frontend.capture import InputRef
from autopart.meta import META_INPUT, META_ROLE, META_SHARD
from autopart.passes.tensor_parallel import TPShard

TP = 2
TIED = {"gpt_sdpa", "gpt_manual", "hf_gpt"}  # LM head tied to the token embedding


@pytest.fixture(scope="module")
def llama() -> Case:
    return llama_case()


@pytest.fixture(params=MODELS)
def vocab(request) -> tuple[str, Case, fx.GraphModule]:
    case = model_case(request, request.param)
    return request.param, case, compiled(request.param, case, TP)


def _ce(gm: fx.GraphModule) -> fx.Node:
    (ce,) = calls(gm, ops.vocab_parallel_ce.default)
    return ce


def _head(gm: fx.GraphModule) -> fx.Node:
    head = through_views(_ce(gm).args[0])
    assert head.meta[META_ROLE] == "vocab"
    return head


def test_one_vocab_parallel_loss(vocab) -> None:
    name, case, gm = vocab
    assert len(calls(case.captured.graph, aten.cross_entropy_loss.default)) == 1
    assert len(calls(gm, ops.vocab_parallel_ce.default)) == 1
    assert calls(gm, aten.cross_entropy_loss.default) == []
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    (loss,) = out.args[0]
    assert loss.args == (_ce(gm), 0)  # the graph returns the op's summed loss


def test_embedding_and_head_keep_vocab_rows(vocab) -> None:
    name, case, gm = vocab
    head_w = _head(gm).args[1]
    (emb,) = [n for n in calls(gm, aten.embedding.default) if n.meta.get(META_ROLE) == "vocab"]
    table = emb.args[0]
    for p in (head_w, table):
        assert p.op == "placeholder" and p.meta[META_SHARD] == TPShard(0)
        V, h = case.captured.vocab_size, hidden_size(case)
        assert tuple(p.meta["val"].shape) == (V // TP, h)
    if name in TIED:  # one logical parameter, one placeholder, one shard
        assert head_w is table
        assert case.captured.tied == {"lm_head.weight": "transformer.wte.weight"}
        assert [f for f in params(gm) if f.endswith("wte.weight")] == ["transformer.wte.weight"]
    else:
        assert head_w is not table
        assert {head_w.meta[META_INPUT].name, table.meta[META_INPUT].name} == {
            "lm_head.weight",
            "model.embed_tokens.weight",
        }
    # only vocab-role matmuls/lookups read the split table
    assert all(u.meta.get(META_ROLE) == "vocab" for u in table.users)


def test_graph_takes_its_tp_rank(vocab) -> None:
    name, case, gm = vocab
    ranks = [p for p in placeholders(gm) if p.meta[META_INPUT] == InputRef("rank", "tp")]
    assert len(ranks) == 1
    (rank,) = ranks
    assert rank.meta["val"].shape == () and rank.meta["val"].dtype == torch.int64
    assert rank.meta[META_SHARD] is None
    assert _ce(gm).args[2] is rank
    # the embedding shifts ids by this rank's first row: tp_rank feeds the lookup too
    (emb,) = [n for n in calls(gm, aten.embedding.default) if n.meta.get(META_ROLE) == "vocab"]
    assert emb in descendants(rank)
    assert [p for p in placeholders(case.captured.graph) if p.meta[META_INPUT].kind == "rank"] == []


def test_only_local_logits_and_labels_enter_the_loss(vocab) -> None:
    name, case, gm = vocab
    ce = _ce(gm)
    logits, labels, rank, group = ce.args
    assert group == "tp" and not ce.kwargs
    V = case.captured.vocab_size
    ids = input_ids_val(gm)
    n_tokens = sym(gm, ids.shape[0]) * sym(gm, ids.shape[1])  # N = b·s
    lv, yv = logits.meta["val"], labels.meta["val"]
    assert lv.dim() == 2 and lv.shape[1] == V // TP
    assert sym(gm, lv.shape[0]) == n_tokens
    assert yv.dim() == 1 and sym(gm, yv.shape[0]) == n_tokens
    loss, row_max, sum_exp = ce.meta["val"]
    assert loss.shape == ()
    assert [sym(gm, t.shape[0]) for t in (row_max, sum_exp)] == [n_tokens, n_tokens]
    # from the head on, no value has the full vocabulary (no gather of the logits)
    head = _head(gm)
    for n in {head} | descendants(head):
        vals = n.meta.get("val")
        for v in vals if isinstance(vals, (tuple, list)) else [vals]:
            if isinstance(v, torch.Tensor):
                assert V not in [d for d in v.shape if isinstance(d, int)], n.name
    # the head's input crosses ranks once, through f
    assert through_views(head.args[0]).target == ops.tp_copy.default


# -- the op itself, in one process -----------------------------------------------------------


@pytest.mark.parametrize("ignored", [0.3, 1.0])
def test_vocab_parallel_ce_matches_cross_entropy(ignored: float, monkeypatch) -> None:
    """With tp world 1 the op is plain summed CE (ignore_index=-100), forward and backward;
    its collectives carry only [N] tensors."""
    g = torch.Generator().manual_seed(1)
    N, V = 37, 11
    logits = (torch.randn(N, V, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < ignored] = -100
    moved: list[tuple[int, ...]] = []
    real = collectives._all_gather

    def spy(x, dim, group):
        moved.append(tuple(x.shape))
        return real(x, dim, group)

    monkeypatch.setattr(collectives, "_all_gather", spy)
    with solo_tp():
        loss, row_max, sum_exp = torch.ops.autopart.vocab_parallel_ce(
            logits, labels, torch.tensor(0), "tp"
        )
        (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, labels, ignore_index=-100, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    assert loss.shape == () and row_max.shape == sum_exp.shape == (N,)
    assert torch.allclose(loss, ref.detach(), rtol=0, atol=1e-12), (loss, ref)
    assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-12)
    assert (grad[labels == -100] == 0).all()
    if ignored == 1.0:
        assert loss.item() == 0.0
    assert moved == [(1, 3, N)]  # one gather of row max, sum of exp, target logit: nothing [N, V]


def _threaded_ce(full: torch.Tensor, labels: torch.Tensor, tp: int, monkeypatch) -> list:
    """tp ranks as threads of this process, gathering through shared memory: each rank's
    (loss, gradient of its vocabulary slice) from ``vocab_parallel_ce``."""
    barrier, slots, me = threading.Barrier(tp, timeout=30), [None] * tp, threading.local()

    def all_gather(x, dim, group):
        slots[me.rank] = x.detach().clone()
        barrier.wait()
        out = torch.cat(slots, dim)
        barrier.wait()
        return out

    monkeypatch.setattr(collectives, "_all_gather", all_gather)
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        me.rank = r
        try:
            local = full.chunk(tp, 1)[r].clone().requires_grad_(True)
            loss, _, _ = torch.ops.autopart.vocab_parallel_ce(local, labels, torch.tensor(r), "tp")
            results[r] = (loss.detach(), torch.autograd.grad(loss, local)[0])
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    with solo_tp():
        collectives.active().bind("tp", object())  # bound: the gather stands in for its group
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return [results[r] for r in range(tp)]


def _reference(full: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ref_logits = full.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, labels, ignore_index=-100, reduction="sum")
    return ref.detach(), torch.autograd.grad(ref, ref_logits)[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_ce_over_threaded_ranks(tp: int, monkeypatch) -> None:
    """Each rank's loss is the full summed CE and its gradient is its vocabulary slice of the
    full gradient."""
    g = torch.Generator().manual_seed(2)
    N, V = 29, 12 * tp
    full = torch.randn(N, V, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, V, (N,), generator=g)  # targets on every rank's slice
    labels[::5] = -100
    ref, ref_grad = _reference(full, labels)
    for r, (loss, grad) in enumerate(_threaded_ce(full, labels, tp, monkeypatch)):
        assert torch.allclose(loss, ref, rtol=0, atol=1e-12), (r, loss, ref)
        assert torch.allclose(grad, ref_grad.chunk(tp, 1)[r], rtol=0, atol=1e-12), r


def test_vocab_parallel_ce_masked_logits_and_bad_labels(monkeypatch) -> None:
    """-inf logits (the column a clamped out-of-slice label reads, a slice of only -inf) give
    F.cross_entropy's loss and gradient, not NaN; a label outside the vocabulary is refused, as
    torch's own CE refuses it."""
    g = torch.Generator().manual_seed(3)
    N, V, tp = 13, 16, 2
    full = torch.randn(N, V, generator=g, dtype=torch.float64)
    full[:, [0, 7, 8]] = float("-inf")  # both ends of rank 0's slice, the start of rank 1's
    full[:4, 8:] = float("-inf")  # rank 1's whole slice, in 4 rows
    labels = torch.randint(1, 7, (N,), generator=g)
    labels[6:] = torch.randint(9, V, (N - 6,), generator=g)
    ref, ref_grad = _reference(full, labels)
    assert torch.isfinite(ref)
    for r, (loss, grad) in enumerate(_threaded_ce(full, labels, tp, monkeypatch)):
        assert torch.allclose(loss, ref, rtol=0, atol=1e-12), (r, loss, ref)
        assert torch.allclose(grad, ref_grad.chunk(tp, 1)[r], rtol=0, atol=1e-12), r
    labels[3] = V
    with pytest.raises(AutopartError, match=f"label {V} is outside the vocabulary"):
        _threaded_ce(full, labels, tp, monkeypatch)


class _SlicedIds(torch.nn.Module):
    """A tied table read with ids that are not ``input_ids`` as they come: XLM's
    ``input_ids[:, -s:]`` (a whole slice) and, once more, the ids reversed."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(64, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids[:, -ids.shape[1] :]) + 0.5 * self.wte(ids.flip(1))
        return self.head(torch.tanh(self.mix(x)))


def test_every_lookup_of_a_tied_split_table_is_split() -> None:
    """Each embedding of the table the head splits by vocabulary rows is looked up split (exact
    for any ids), where one not reading ``input_ids`` as such was refused: "split over tp but
    … reads it whole". On 2 gloo ranks: the loss and every gradient as on one device."""
    from autopart import Mesh, parallelize
    from autopart.parity.verify import Check, verify_many

    def make():
        torch.manual_seed(0)
        ids, labels = torch.randint(0, 64, (2, 2, 16))
        return _SlicedIds(), (ids, labels)

    model, batch = make()
    rank = parallelize(model, Mesh(tp=2), batch).rank(0)
    assert rank.shards["wte.weight"].dim == 0  # split by vocabulary rows, not refused
    lookups = calls(rank.stages[0].graph, aten.embedding.default)
    assert len(lookups) == 2
    assert all(tuple(n.args[0].meta["val"].shape) == (32, 16) for n in lookups)  # 64 / tp rows
    (report,) = verify_many({"tp": Check(make, tp=2)}, via="fork", timeout_s=60).values()
    assert not isinstance(report, Exception) and report.ok, str(report)
