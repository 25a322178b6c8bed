"""sequence_parallel: with ``Plan(Mesh(tp=2), sequence_parallel=True)`` every f/g of the
tensor-parallel graph becomes an all-gather / reduce-scatter along the sequence, replicated
parameters all-reduce their gradients, and a learned position table is cut to this rank's rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import Case
from torch import fx
from tp_models import (
    MODELS,
    ancestors,
    aten,
    calls,
    compiled,
    hidden_size,
    llama_case,
    model_case,
    n_layers,
    ops,
    params,
    per_layer,
    run_local,
    sym,
)

from autopart.errors import AutopartError
from autopart.frontend.capture import B, S
from autopart.layout import Mesh, Plan
from autopart.meta import META_INPUT, META_LAYER, META_SEQ, META_SHARD

TP = 2
_GPT = (
    "transformer.ln_f.weight",
    "transformer.ln_f.bias",
    *(
        f"transformer.h.*.{p}"
        for p in (
            "ln_1.weight",
            "ln_1.bias",
            "ln_2.weight",
            "ln_2.bias",
            "attn.c_proj.bias",
            "mlp.c_proj.bias",
        )
    ),
)
GRAD_REDUCED = {  # every replicated parameter read row by row: norms, row biases
    "gpt_sdpa": _GPT,
    "gpt_manual": _GPT,
    "hf_gpt": _GPT,
    "llama": (
        "model.layers.*.input_layernorm.weight",
        "model.layers.*.post_attention_layernorm.weight",
        "model.norm.weight",
    ),
}


@pytest.fixture(scope="module")
def llama() -> Case:
    return llama_case()


@pytest.fixture(params=MODELS)
def seq(request) -> tuple[str, Case, fx.GraphModule]:
    case = model_case(request, request.param)
    return request.param, case, compiled(request.param, case, TP, sp=True)


def test_f_and_g_become_gather_and_reduce_scatter(seq) -> None:
    name, case, gm = seq
    blocks = dict.fromkeys(range(n_layers(case)), 2)
    assert per_layer(calls(gm, ops.tp_gather.default)) == {**blocks, None: 1}  # + LM head
    assert per_layer(calls(gm, ops.tp_scatter_reduce.default)) == {**blocks, None: 1}  # + emb
    assert calls(gm, ops.tp_copy.default) == []
    assert calls(gm, ops.tp_reduce.default) == []
    for op in (ops.tp_gather.default, ops.tp_scatter_reduce.default):  # group and its size
        assert all(n.args[2:] == ("tp", TP) for n in calls(gm, op))


def _at(gm: fx.GraphModule, size: object, s: int = 12) -> int:
    """A size at sequence length ``s`` (a multiple of tp, as the runtime requires), batch 3."""
    return int(sym(gm, size).xreplace({S: s, B: 3}))


def _seq_dims(gm: fx.GraphModule, shape) -> list[int]:
    return [i for i, d in enumerate(shape) if S in sym(gm, d).free_symbols]


def test_collectives_act_on_the_sequence_dim(seq) -> None:
    name, case, gm = seq
    h = hidden_size(case)
    for r in calls(gm, ops.tp_scatter_reduce.default):  # (b, s, h) → (b, s/tp, h)
        x, dim, *_ = r.args
        shape = x.meta["val"].shape
        assert _seq_dims(gm, shape) == [dim] == [1], (r.name, shape)
        assert [_at(gm, d) for d in shape] == [3, 12, h]
        assert [_at(gm, d) for d in r.meta["val"].shape] == [3, 12 // TP, h]
        assert r.meta[META_SEQ] == 1
    for g in calls(gm, ops.tp_gather.default):  # (b, s/tp, h) → (b, s, h)
        x, dim, *_ = g.args
        shape = x.meta["val"].shape
        assert _seq_dims(gm, shape) == [dim] == [1], (g.name, shape)
        assert [_at(gm, d) for d in shape] == [3, 12 // TP, h]
        assert [_at(gm, d) for d in g.meta["val"].shape] == [3, 12, h]
        assert x.meta.get(META_SEQ) == 1
    # the embedding's reduce-scatter is the first to see the captured sequence length itself
    first = calls(gm, ops.tp_scatter_reduce.default)[0]
    assert first.meta[META_LAYER] is None
    assert sym(gm, first.args[0].meta["val"].shape[1]) == S


def test_replicated_params_all_reduce_their_gradient(seq) -> None:
    name, case, gm = seq
    reducing = calls(gm, ops.tp_all_reduce_grad.default)
    reduced = {n.args[0] for n in reducing}
    assert len(reduced) == len(reducing)  # one per parameter
    for fqn, p in params(gm).items():
        if fqn == "transformer.wpe.weight":  # cut by tp_split: its gradient is whole
            assert p not in reduced
        elif p.meta[META_SHARD] is None:  # norms, row biases
            assert p in reduced, fqn
            ((user, _),) = p.users.items()  # every use goes through the gradient all-reduce
            assert user.target == ops.tp_all_reduce_grad.default and user.args == (p, "tp")
        else:
            assert p not in reduced, fqn
    names = {p.meta[META_INPUT].name for p in reduced}
    layers = range(n_layers(case))
    expected = {f.replace("*", str(i)) for f in GRAD_REDUCED[name] for i in layers}
    assert names == expected


@pytest.mark.parametrize("name", ["gpt_sdpa", "gpt_manual", "hf_gpt"])
def test_position_table_is_cut_to_local_rows(name: str, request) -> None:
    """The learned positions (whole on every rank) meet the split token embedding through
    ``tp_split``: this rank's rows forward, an all-gather of their gradient backward, so the
    table's gradient is whole and is not reduced again (it was ``index_select`` by ``tp_rank``
    with the table's gradient all-reduced, until whole values of any kind were cut alike)."""
    case = model_case(request, name)
    gm = compiled(name, case, TP, sp=True)
    (wpe,) = [p for f, p in params(gm).items() if f == "transformer.wpe.weight"]
    (cut,) = calls(gm, ops.tp_split.default)
    table, dim, group, size = cut.args
    assert wpe in ancestors(table) and (group, size) == ("tp", TP)
    assert sym(gm, table.meta["val"].shape[dim]) == S  # the whole sequence ...
    assert sym(gm, cut.meta["val"].shape[dim]) != S  # ... down to this rank's rows
    assert calls(gm, aten.index_select.default) == []
    (add,) = cut.users  # added to the sequence-split token embedding
    assert any(a.target == ops.tp_scatter_reduce.default for a in add.args)
    assert ops.tp_all_reduce_grad.default not in {u.target for u in wpe.users}


@pytest.mark.parametrize(
    ("name", "tp"),
    [
        *((m, 2) for m in MODELS),
        ("gpt_sdpa", 4),
        pytest.param("hf_gpt", 4, marks=pytest.mark.slow),  # suite time: gpt_sdpa has tp = 4
    ],
)
def test_sequence_parallel_graph_runs_in_one_process(name: str, tp: int, request) -> None:
    """Rank 0's graph, every collective the identity (so rank 0 keeps the whole sequence)."""
    case = model_case(request, name)
    gm = compiled(name, case, tp, sp=True)
    loss = run_local(case, gm, tp)
    assert loss.dim() == 0 and torch.isfinite(loss) and loss > 0


def test_sequence_parallel_needs_tp() -> None:
    with pytest.raises(AutopartError) as err:
        Plan(Mesh(dp=2), sequence_parallel=True)
    assert "needs tensor parallelism (tp > 1)" in err.value.message
    assert "tp ≥ 2" in err.value.hint


class _OnePlusNorm(torch.nn.Module):
    """Gemma's RMS norm: the weight enters as ``1 + w`` (cast first), not directly."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * (1.0 + self.weight.to(x.dtype))


def _gemma_like(norm: type[torch.nn.Module] = _OnePlusNorm):
    """A two-block Llama-style toy whose norms read their weight as ``1 + w`` (or are
    ``norm``)."""
    import hf_llama

    model, batch = hf_llama.make()
    h = model.config.hidden_size
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.input_layernorm = norm(h)
        layer.post_attention_layernorm = norm(h)
    model.model.norm = norm(h)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    return model, batch


@pytest.mark.multirank
def test_a_norm_weight_read_through_one_plus_w_reduces_its_gradient() -> None:
    """Sequence parallelism: a replicated weight reaching the split rows through values
    computed from it alone (Gemma's ``1 + w``, a cast) has a per-rank partial gradient, and is
    all-reduced over tp like one read directly. It was not (only direct reads were looked
    for): Gemma 2's norm gradients came out 100 % off under tp=2 with sp, silently."""
    from autopart.parity.verify import Check, verify_many

    (report,) = verify_many(
        [Check(_gemma_like, tp=2, sequence_parallel=True)], via="fork", timeout_s=120
    ).values()
    assert not isinstance(report, AutopartError), report
    assert report.ok and report.tolerance == 1e-9, str(report)


def _torch_rms_norms() -> tuple:
    return _gemma_like(torch.nn.RMSNorm)


@pytest.mark.slow  # suite time: a second launch of the toy above
@pytest.mark.multirank
def test_torch_rms_norm_passes_sequence_parallelism() -> None:
    """torch's own ``nn.RMSNorm`` is one ``aten.rms_norm``, which had no sharding rule: sequence
    parallelism refused it ("no sharding rule for aten.rms_norm.default"). It now splits like
    ``layer_norm``, with its weight's gradient reduced over tp: float64 parity."""
    from autopart.parity.verify import Check, verify_many

    (report,) = verify_many(
        [Check(_torch_rms_norms, tp=2, sequence_parallel=True)], via="fork", timeout_s=120
    ).values()
    assert not isinstance(report, AutopartError), report
    assert report.ok and report.tolerance == 1e-9, str(report)


class _SoftmaxMLP(torch.nn.Module):
    """An MLP whose hidden goes through a softmax over its features: tensor parallelism leaves
    both linears replicated (the softmax works along the split)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.softmax(self.up(x), dim=-1) * self.up.out_features)


def _replicated_mlps() -> tuple:
    import hf_llama

    model, batch = hf_llama.make()
    torch.manual_seed(2)
    for layer in model.model.layers:
        layer.mlp = _SoftmaxMLP(model.config.hidden_size)
    return model, batch


@pytest.mark.multirank
def test_a_linear_tp_left_replicated_works_row_by_row_under_sequence_parallelism() -> None:
    """A linear tensor parallelism leaves replicated, on rows split along the sequence, works
    row by row: its output keeps the split and its weight's gradient is all-reduced over tp
    like a norm's. Sequence parallelism refused it ("no sharding rule for aten.linear"), though
    plain tp ran it (tp probe, seventeenth session): float64 parity now."""
    from autopart.parity.verify import Check, verify_many

    (report,) = verify_many(
        [Check(_replicated_mlps, tp=2, sequence_parallel=True)], via="fork", timeout_s=120
    ).values()
    assert not isinstance(report, AutopartError), report
    assert report.ok and report.tolerance == 1e-9, str(report)


class _OneHotEmbedding(torch.nn.Module):
    """A token embedding written as ``one_hot(ids) @ table``: no ``aten.embedding``."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(table.detach().clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(ids, self.weight.shape[0]).to(self.weight) @ self.weight


@pytest.mark.parametrize("vocab", [96, 97])  # split by vocabulary, or whole
def test_sequence_parallelism_without_a_token_embedding_is_refused(vocab: int) -> None:
    """The split starts at the token embedding (its reduce-scatter, or ``tp_split`` after a
    whole one): a model with no ``embedding`` of ``input_ids`` is refused at compile time,
    whatever the vocabulary (the same model with its embedding compiles: the tests above)."""
    from autopart.frontend.capture import capture
    from autopart.lowering.compile import compile_program
    from autopart.models import zoo

    model, batch = zoo.make("llama", vocab_size=vocab)
    model.model.embed_tokens = _OneHotEmbedding(model.model.embed_tokens.weight)
    captured = capture(model.double(), batch)
    with pytest.raises(AutopartError, match="sequence parallelism starts at the token embedding"):
        compile_program(captured, Plan(Mesh(tp=2), sequence_parallel=True))


@pytest.mark.multirank
def test_what_a_probe_found_silently_wrong_under_sequence_parallelism() -> None:
    """tests/sp_models.py on real ranks, float64 against one device: a chunk along the
    sequence (each rank chunked its own rows: loss 1e-2 off), reductions over every dim
    written ``dim=()`` (read as over none: a gate's gradient 100 % off) or ``dim=None`` (a
    TypeError in the pass), and a scale from the activations on the vocabulary-split logits
    (under tp alone too: its gradient came from one rank's slice of the vocabulary)."""
    from autopart.parity.verify import Check, verify_many

    spec = f"{Path(__file__).parents[1] / 'sp_models.py'}"
    checks = {
        f"{kind}-sp": Check(f"{spec}:{kind}", tp=2, sequence_parallel=True)
        for kind in ("halves_swapped", "sum_of_all", "max_of_all", "mean_of_all", "logit_scale")
    }
    checks["logit_scale-tp"] = Check(f"{spec}:logit_scale", tp=2)
    for name, report in verify_many(checks, via="fork", timeout_s=120).items():
        assert not isinstance(report, AutopartError), (name, report)
        assert report.ok and report.tolerance == 1e-9, (name, str(report))
