"""tensor_parallel: the Megatron layout the pass docstring promises, checked on the graph after
the whole PIPELINE (single process, no ranks): shards, f/g per block on (b, s, h), shape
literals divided by tp, local placeholder shapes, a graph that runs on local shards, and the
refusals (AutopartError with a hint) and the replicated fallback (a warning naming the node)."""

from __future__ import annotations

import logging
from typing import Any

import kv_models
import nanogpt
import pytest
import torch
import torch.nn.functional as F
from conftest import Case, _case
from torch import fx, nn
from tp_models import (
    MODELS,
    VIEWS,
    ancestors,
    aten,
    calls,
    compiled,
    hidden_size,
    is_bsh,
    llama_case,
    model_case,
    n_layers,
    ops,
    params,
    pattern,
    per_layer,
    run_local,
    sym,
    through_views,
)

from autopart.graph import copy_graph
from autopart.layout import Mesh, Plan
from autopart.lowering.pass_runner import run_passes
from autopart.meta import (
    META_GLOBAL_VAL,
    META_INPUT,
    META_LAYER,
    META_MODULE,
    META_ROLE,
    META_SHARD,
    META_TP_SPLIT,
)
from autopart.passes import PIPELINE
from autopart.passes.tensor_parallel import TPShard

COL, ROW = TPShard(0), TPShard(1)  # nn.Linear stores [out, in]
NANO = {
    "transformer.wte.weight": TPShard(0),  # vocab rows (tied with lm_head)
    "transformer.wpe.weight": None,
    "transformer.h.*.ln_1.weight": None,
    "transformer.h.*.ln_1.bias": None,
    "transformer.h.*.attn.c_attn.weight": TPShard(0, 3),  # fused QKV: strided
    "transformer.h.*.attn.c_attn.bias": TPShard(0, 3),
    "transformer.h.*.attn.c_proj.weight": ROW,
    "transformer.h.*.attn.c_proj.bias": None,
    "transformer.h.*.ln_2.weight": None,
    "transformer.h.*.ln_2.bias": None,
    "transformer.h.*.mlp.c_fc.weight": COL,
    "transformer.h.*.mlp.c_fc.bias": TPShard(0),
    "transformer.h.*.mlp.c_proj.weight": ROW,
    "transformer.h.*.mlp.c_proj.bias": None,
    "transformer.ln_f.weight": None,
    "transformer.ln_f.bias": None,
}
GPT2 = {  # HF Conv1D stores [in, out]: column dim 1, row dim 0
    **NANO,
    "transformer.h.*.attn.c_attn.weight": TPShard(1, 3),
    "transformer.h.*.attn.c_proj.weight": TPShard(0),
    "transformer.h.*.mlp.c_fc.weight": TPShard(1),
    "transformer.h.*.mlp.c_proj.weight": TPShard(0),
}
LLAMA = {
    "model.embed_tokens.weight": TPShard(0),
    "model.layers.*.input_layernorm.weight": None,
    "model.layers.*.self_attn.q_proj.weight": COL,
    "model.layers.*.self_attn.k_proj.weight": COL,
    "model.layers.*.self_attn.v_proj.weight": COL,
    "model.layers.*.self_attn.o_proj.weight": ROW,
    "model.layers.*.post_attention_layernorm.weight": None,
    "model.layers.*.mlp.gate_proj.weight": COL,
    "model.layers.*.mlp.up_proj.weight": COL,
    "model.layers.*.mlp.down_proj.weight": ROW,
    "model.norm.weight": None,
    "lm_head.weight": TPShard(0),  # untied LM head: vocab rows
}
LAYOUT = {"gpt_sdpa": NANO, "gpt_manual": NANO, "hf_gpt": GPT2, "llama": LLAMA}


@pytest.fixture(scope="module")
def llama() -> Case:
    return llama_case()


@pytest.fixture(
    params=[  # tp=4 on Llama (GQA: 2 K/V heads a rank at tp=2, 1 at tp=4) by default; all: -m slow
        (m, tp) if tp == 2 or m == "llama" else pytest.param((m, tp), marks=pytest.mark.slow)
        for m in MODELS
        for tp in (2, 4)
    ],
    ids=lambda p: f"{p[0]}-tp{p[1]}",
)
def split(request) -> tuple[str, Case, int, fx.GraphModule]:
    """(model name, its case, tp, the graph after PIPELINE at Mesh(tp=tp))."""
    name, tp = request.param
    case = model_case(request, name)
    return name, case, tp, compiled(name, case, tp)


def test_shards_follow_the_weight_layout(split) -> None:
    name, case, tp, gm = split
    table = LAYOUT[name]
    got = {fqn: p.meta[META_SHARD] for fqn, p in params(gm).items()}
    assert set(got) == set(case.captured.params)  # one placeholder per (tied) parameter
    assert {pattern(f) for f in got} == set(table), "the table must name every parameter"
    for fqn, shard in got.items():
        assert shard == table[pattern(fqn)], fqn


def test_split_placeholders_hold_local_shapes(split) -> None:
    name, case, tp, gm = split
    for fqn, p in params(gm).items():
        full = tuple(case.captured.params[fqn].shape)
        shard = p.meta[META_SHARD]
        local = list(full)
        if shard is not None:
            local[shard.dim] //= tp
            assert tuple(p.meta[META_GLOBAL_VAL].shape) == full, fqn
        assert tuple(p.meta["val"].shape) == tuple(local), fqn
    # the shared capture is left whole
    for p in case.captured.placeholders("param"):
        assert META_SHARD not in p.meta
        fqn = p.meta[META_INPUT].name
        assert tuple(p.meta["val"].shape) == tuple(case.captured.params[fqn].shape)


def test_two_f_and_two_g_per_block(split) -> None:
    name, case, tp, gm = split
    blocks = set(range(n_layers(case)))
    reduces, copies = calls(gm, ops.tp_reduce.default), calls(gm, ops.tp_copy.default)
    assert blocks == {0, 1}
    assert per_layer(reduces) == {**dict.fromkeys(blocks, 2), None: 1}
    assert per_layer(copies) == {**dict.fromkeys(blocks, 2), None: 1}
    # outside blocks: the vocab embedding's g and the LM head's f
    (emb_g,) = [g for g in reduces if g.meta[META_LAYER] is None]
    assert any(
        a.meta.get(META_ROLE) == "vocab" and a.target == aten.embedding.default
        for a in ancestors(emb_g)
    )
    (head_f,) = [f for f in copies if f.meta[META_LAYER] is None]
    assert [u.meta.get(META_ROLE) for u in _downstream_matmuls(head_f)] == ["vocab"]


def _downstream_matmuls(f: fx.Node) -> list[fx.Node]:
    """The matmuls ``f`` feeds through views."""
    out, stack = [], list(f.users)
    while stack:
        u = stack.pop()
        if u.target in VIEWS:
            stack.extend(u.users)
        else:
            out.append(u)
    return out


def test_g_follows_each_row_matmul_on_bsh(split) -> None:
    name, case, tp, gm = split
    h = hidden_size(case)
    biased = name != "llama"
    by_name = params(gm)
    in_blocks = [g for g in calls(gm, ops.tp_reduce.default) if g.meta[META_LAYER] is not None]
    assert len(in_blocks) == 2 * n_layers(case)
    for g in in_blocks:
        assert is_bsh(gm, g.meta["val"], h), (g.name, g.meta["val"].shape)
        row = through_views(g.args[0])
        assert row.meta[META_ROLE] == "row" and row.meta[META_LAYER] == g.meta[META_LAYER]
        assert row.target in (aten.linear.default, aten.mm.default) and len(row.args) == 2
        weight = row.args[1]
        assert weight.meta[META_SHARD] is not None and weight.meta[META_SHARD].dim in (0, 1)
        if biased:  # the row bias is added once, after the reduction
            (add,) = g.users
            assert add.target == aten.add.Tensor and add.args[0] is g
            bias = add.args[1]
            assert bias.op == "placeholder" and bias.meta[META_SHARD] is None
            assert bias in by_name.values() and bias.meta[META_INPUT].name.endswith("c_proj.bias")


def test_f_feeds_column_matmuls_on_bsh(split) -> None:
    name, case, tp, gm = split
    h = hidden_size(case)
    copies = calls(gm, ops.tp_copy.default)
    for f in copies:
        assert is_bsh(gm, f.meta["val"], h), (f.name, f.meta["val"].shape)
        roles = {m.meta.get(META_ROLE) for m in _downstream_matmuls(f)}
        assert roles == ({"vocab"} if f.meta[META_LAYER] is None else {"column"}), f.name
    columns = [n for n in gm.graph.nodes if n.meta.get(META_ROLE) == "column"]
    assert len(columns) == n_layers(case) * (5 if name == "llama" else 2)  # q,k,v,gate,up
    for c in columns:
        x = c.args[1] if c.target == aten.addmm.default else c.args[0]
        assert through_views(x).target == ops.tp_copy.default, c.name


def _same_size(gm: fx.GraphModule, a: object, b: object) -> bool:
    return sym(gm, a) == sym(gm, b)


def test_shape_literals_are_divided(split) -> None:
    """Every view/reshape/expand literal naming a split size is divided by tp, no other one."""
    name, case, tp, gm = split
    before = {n.name: n for n in case.captured.graph.graph.nodes}
    divided = []
    targets = (*VIEWS, aten.expand.default)
    for n in gm.graph.nodes:
        if n.target not in targets or n.name not in before:
            continue
        old = before[n.name]
        assert old.target == n.target
        g, loc = old.meta["val"].shape, n.meta["val"].shape
        assert len(g) == len(loc)
        changed = [i for i in range(len(g)) if not _same_size(gm, g[i], loc[i])]
        assert len(changed) <= 1, (n.name, g, loc)
        for i in changed:
            assert sym(gm, loc[i]) * tp == sym(gm, g[i]), (n.name, g, loc)
        for i, (a, b) in enumerate(zip(old.args[1], n.args[1], strict=True)):
            if isinstance(a, int) and a != -1 and i in changed:
                assert b == a // tp, (n.name, old.args[1], n.args[1])
                divided.append((n.name, a, b))
            elif isinstance(a, int):
                assert b == a, (n.name, old.args[1], n.args[1])
    assert divided, "some literal encodes a head count or a width"
    if name.startswith("gpt_"):  # q, k, v.view(B, T, 4, 8) in each block
        heads = [
            n
            for n in gm.graph.nodes
            if n.target == aten.view.default and list(before[n.name].args[1][2:]) == [4, 8]
        ]
        assert len(heads) == 3 * n_layers(case)
        assert all(list(n.args[1][2:]) == [4 // tp, 8] for n in heads)
    if name == "hf_gpt":  # qkv.split(32, dim=2) → split(32 / tp)
        splits = calls(gm, aten.split.Tensor)
        assert len(splits) == n_layers(case)
        assert all(before[s.name].args[1] == 32 and s.args[1] == 32 // tp for s in splits)
    if name == "llama":  # GQA: k/v (b, 4 kv heads, 2 rep, s, 8) → (b, 8 heads, s, 8)
        expands = [n for n in calls(gm, aten.expand.default) if n.meta[META_LAYER] is not None]
        assert len(expands) == 2 * n_layers(case)
        assert all(n.args[1][1:3] == [4 // tp, 2] for n in expands)


def test_runs_on_local_shards_in_one_process(split) -> None:
    name, case, tp, gm = split
    loss = run_local(case, gm, tp)
    assert loss.dim() == 0 and loss.dtype == torch.float64
    assert torch.isfinite(loss) and loss > 0


# -- refusals --------------------------------------------------------------------------------


def _compile(case: Case, tp: int, **plan: Any) -> fx.GraphModule:
    return run_passes(copy_graph(case.captured.graph), Plan(Mesh(tp=tp), **plan), PIPELINE)[0]


def _split_and_said(case: Case, tp: int, caplog: pytest.LogCaptureFixture) -> tuple[dict, str]:
    """Each parameter's shard after the passes at ``tp``, and what they logged."""
    with caplog.at_level("WARNING", logger="autopart"):
        gm = _compile(case, tp)
    return {f: p.meta[META_SHARD] for f, p in params(gm).items()}, caplog.text


def test_heads_not_divisible_by_tp(caplog: pytest.LogCaptureFixture) -> None:
    """3 heads at tp=2 refused the whole plan; the attention stays replicated now, naming the
    head count, and the MLP still splits (parity on real ranks: ``gpt2-heads6-tp4``)."""
    case = _case(lambda: nanogpt.make(n_head=3, n_embd=48))
    shards, said = _split_and_said(case, 2, caplog)
    assert "leaving linear (transformer.h.0.attn.c_attn) replicated" in said, said
    assert "3 is not divisible by tp=2" in said, said
    assert shards["transformer.h.0.attn.c_attn.weight"] is None
    assert shards["transformer.h.0.mlp.c_fc.weight"] == COL


def test_fewer_heads_than_tp(gpt_sdpa: Case, caplog: pytest.LogCaptureFixture) -> None:
    shards, said = _split_and_said(gpt_sdpa, 8, caplog)
    assert "4 is not divisible by tp=8" in said, said
    assert shards["transformer.h.0.attn.c_attn.weight"] is None
    assert shards["transformer.h.0.mlp.c_fc.weight"] == COL  # 128 / 8


def _rank_rows(gm: fx.GraphModule, select: fx.Node, tp: int) -> list[list[int]]:
    """The rows ``select`` (an index_select of key/value heads) reads on each of tp ranks,
    evaluated from the graph's own index nodes."""
    rows = []
    for rank in range(tp):
        env: dict[fx.Node, object] = {}
        for n in gm.graph.nodes:
            if n.op == "placeholder" and n.meta[META_INPUT].kind == "rank":
                env[n] = torch.tensor(rank)
            elif n.op == "call_function" and n in ancestors(select.args[2]) | {select.args[2]}:
                env[n] = n.target(*fx.map_arg(n.args, env.__getitem__), **n.kwargs)
        rows.append(env[select.args[2]].tolist())
    return rows


def _before_transposes(n: fx.Node) -> fx.Node:
    while n.target == aten.transpose.int:
        n = n.args[0]
    return n


def test_fewer_kv_heads_than_tp_are_kept_whole_and_selected(llama: Case) -> None:
    """Llama's 4 KV heads at tp=8 (8 query heads): q, o and the MLP split as usual; k_proj and
    v_proj are replicated, their weights' gradients summed over tp, their input the query's f;
    each attention reads rank r's row of the repeated keys and values (query head r's)."""
    gm = _compile(llama, 8)
    shards = {pattern(f): p.meta[META_SHARD] for f, p in params(gm).items()}
    assert shards["model.layers.*.self_attn.q_proj.weight"] == COL
    assert shards["model.layers.*.self_attn.o_proj.weight"] == ROW
    assert shards["model.layers.*.mlp.up_proj.weight"] == COL
    for name in ("k_proj", "v_proj"):
        assert shards[f"model.layers.*.self_attn.{name}.weight"] is None
        for layer in range(n_layers(llama)):
            w = params(gm)[f"model.layers.{layer}.self_attn.{name}.weight"]
            assert [u.target for u in w.users] == [ops.tp_all_reduce_grad.default]
            (lin,) = next(iter(w.users)).users
            q_weight = params(gm)[f"model.layers.{layer}.self_attn.q_proj.weight"]
            assert lin.args[0].target == ops.tp_copy.default  # the query's f:
            assert any(u.args[1] is q_weight for u in lin.args[0].users)
    sdpas = calls(gm, aten.scaled_dot_product_attention.default)
    assert len(sdpas) == n_layers(llama)
    for sdpa in sdpas:
        for kv in sdpa.args[1:3]:
            assert kv.target == aten.index_select.default and kv.args[1] == 1
            assert tuple(kv.meta["val"].shape[1:2]) == (1,)  # one of the 8 repeated heads
            assert _rank_rows(gm, kv, 8) == [[r] for r in range(8)]


def test_one_kv_head_is_shared_by_every_rank() -> None:
    """SDPA's ``enable_gqa`` with 1 and 2 key/value heads at tp=4: the keys and values stay
    un-repeated and each rank selects the one head its query heads share (rank // (tp/kv))."""
    for make, expected in (
        (kv_models.gqa_kv1, [[0]] * 4),
        (kv_models.gqa_kv2, [[0], [0], [1], [1]]),
    ):
        gm = _compile(_case(make), 4)
        assert params(gm)["attn.0.k.weight"].meta[META_SHARD] is None
        assert params(gm)["attn.0.k.bias"].meta[META_SHARD] is None
        assert params(gm)["attn.0.q.weight"].meta[META_SHARD] == COL
        for sdpa in calls(gm, aten.scaled_dot_product_attention.default):
            k, v = (_before_transposes(x) for x in sdpa.args[1:3])
            assert k.target == v.target == aten.index_select.default
            assert _rank_rows(gm, k, 4) == _rank_rows(gm, v, 4) == expected


def test_heads_repeated_by_repeat_interleave_split_with_their_query_heads() -> None:
    """GQA written by hand, ``k.repeat_interleave(rep, dim=1)``, kept the whole attention
    replicated ("no sharding rule"): a rank's block of key heads, each repeated in place, is
    the block its query heads read, so q, k and v split at tp = 2 (2 key heads), and at tp = 4
    (1 key head) k and v stay whole and each rank selects its 2 of the 8 repeated heads.
    Tiled heads (``k.repeat(1, rep, 1, 1)``: query head j reads j % kv) keep it replicated."""
    gm = _compile(_case(kv_models.interleave_kv2), 2)
    for w in ("q", "k", "v"):
        assert params(gm)[f"attn.0.{w}.weight"].meta[META_SHARD] == COL, w
    assert not calls(gm, aten.index_select.default)
    gm = _compile(_case(kv_models.interleave_kv1), 4)
    assert params(gm)["attn.0.k.weight"].meta[META_SHARD] is None
    assert params(gm)["attn.0.q.weight"].meta[META_SHARD] == COL
    for sdpa in calls(gm, aten.scaled_dot_product_attention.default):
        k = _before_transposes(sdpa.args[1])
        assert k.target == aten.index_select.default
        assert _rank_rows(gm, k, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    gm = _compile(_case(kv_models.tiled_kv2), 2)
    for w in ("q", "k", "v"):
        assert params(gm)[f"attn.0.{w}.weight"].meta[META_SHARD] is None, w


def test_an_eager_attention_selects_its_keys_before_the_transpose() -> None:
    """Eager, soft-capped attention over one repeated KV head at tp=2: q·kᵀ and p·v read a
    select of this rank's 4 of the 8 repeated heads, put before kᵀ so the general form's k is
    the select (sequence_chunk joins the K prefix there); the causal mask's key length reads
    the select too."""
    gm = _compile(_case(kv_models.eager_mqa), 2)
    assert params(gm)["attn.0.k.weight"].meta[META_SHARD] is None
    selects = calls(gm, aten.index_select.default)
    assert len(selects) == 4  # k and v of 2 layers
    for sel in selects:
        assert tuple(sel.meta["val"].shape[1:2]) == (4,)
        assert _rank_rows(gm, sel, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        (user,) = sel.users
        if user.target == aten.transpose.int:  # kᵀ
            (user,) = user.users
        assert user.target == aten.matmul.default
    assert not calls(gm, aten.scaled_dot_product_attention.default)


@pytest.mark.slow
def test_only_keys_and_values_kept_whole_are_cut(caplog) -> None:
    """gpt-oss under tp=2: its sinks leave q and k replicated while v's projection could split;
    the probabilities (replicated, not keys or values kept whole) are not cut to the split
    heads: v and o stay replicated, with a warning, as before replicated key/value heads (the
    cut once broke its Seq1F1B cell)."""
    from autopart.models import zoo

    with caplog.at_level(logging.WARNING, logger="autopart"):
        gm = _compile(_case(lambda: zoo.make("gpt_oss")), 2)
    assert params(gm)["model.layers.0.self_attn.v_proj.weight"].meta[META_SHARD] is None
    assert not [n for n in calls(gm, aten.index_select.default) if META_TP_SPLIT in n.meta]
    said = [r.getMessage() for r in caplog.records]
    assert any("(model.layers.0.self_attn.v_proj)" in m and "not keys or" in m for m in said), said


def test_kv_heads_tp_cannot_share_out_leave_the_attention_replicated(caplog) -> None:
    """3 key/value heads read by ``enable_gqa`` at tp=2: no rank's query heads share one head,
    so the attention stays replicated, with a warning naming it and the head count."""
    with caplog.at_level(logging.WARNING, logger="autopart"):
        gm = _compile(_case(kv_models.gqa_kv3), 2)
    assert params(gm)["attn.0.q.weight"].meta[META_SHARD] is None
    assert not calls(gm, aten.index_select.default)
    said = [r.getMessage() for r in caplog.records]
    assert any(
        "(attn.0.q) replicated" in m
        and "(attn.0) has 3 key/value heads, which tp = 2 neither divides nor is a multiple of" in m
        for m in said
    ), said


def test_kv_gradients_are_summed_before_a_less_precise_norm() -> None:
    """Qwen3's key norm computes in float32 inside a float64 model: the ranks' gradient shares
    are summed where the norm hands its float64 output on (one tp_all_reduce_grad on that
    cast), not after float32 rounding, so k_proj reads x directly and its weight unreduced."""
    gm = _compile(_case(kv_models.qwen3_mqa), 2)
    w = params(gm)["model.layers.0.self_attn.k_proj.weight"]
    assert [u.target for u in w.users] == [aten.linear.default]
    assert next(iter(w.users)).args[0].target != ops.tp_copy.default
    norm_w = params(gm)["model.layers.0.self_attn.k_norm.weight"]
    assert [u.target for u in norm_w.users] == [ops.tp_all_reduce_grad.default]
    layer0 = [
        n
        for n in calls(gm, ops.tp_all_reduce_grad.default)
        if n.meta.get(META_MODULE) == "model.layers.0.self_attn.k_norm" and n.args[0] is not norm_w
    ]
    assert len(layer0) == 1
    cast = layer0[0].args[0]
    assert cast.meta["val"].dtype == torch.float64
    assert cast.args[0].meta["val"].dtype == torch.float32


class WideMLP(nn.Module):
    """A GELU MLP of any width."""

    def __init__(self, n_embd: int, width: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(n_embd, width), nn.Linear(width, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


def _with_mlp(factory) -> Case:
    def make():
        model, batch = nanogpt.make()
        for block in model.transformer.h:
            block.mlp = factory(block.mlp)
        return model, batch

    return _case(make)


def test_mlp_width_not_divisible_by_tp(caplog: pytest.LogCaptureFixture) -> None:
    """An MLP width of 50 splits at tp=2; at tp=4 it refused the whole plan, and now stays
    replicated, naming the width, while the attention splits (transformers' own test configs
    use a width of 37: ``llama-hf-tester-tp2`` on real ranks)."""
    case = _with_mlp(lambda mlp: WideMLP(32, 50))  # 50 = 2 · 25: fine at tp=2, not at tp=4
    gm = _compile(case, 2)
    assert params(gm)["transformer.h.0.mlp.c_fc.weight"].meta[META_SHARD] == COL
    shards, said = _split_and_said(case, 4, caplog)
    assert "(transformer.h.0.mlp.c_fc) replicated" in said and "50 is not divisible by tp=4" in said
    assert shards["transformer.h.0.mlp.c_fc.weight"] is None
    assert shards["transformer.h.0.attn.c_attn.weight"] is not None


def test_a_vocabulary_tp_does_not_divide_stays_whole(caplog: pytest.LogCaptureFixture) -> None:
    """GPT-2's 50257, a test config's 97: refused before; now the embedding, the LM head and
    the plain cross entropy stay whole on every tp rank (the blocks still split), with one
    warning naming the padding, and none of tensor_parallel's about the head; with sequence
    parallelism the split runs from after the embedding to before the head. Parity on real
    ranks: tests/parity_cases.py (``ODD_CASES``)."""
    case = _case(lambda: nanogpt.make(vocab_size=97))
    with caplog.at_level("WARNING", logger="autopart"):
        gm = _compile(case, 2)
    said = [r.getMessage() for r in caplog.records]
    assert any("vocabulary (97) is not divisible by tp=2" in m for m in said), said
    assert not any("lm_head" in m for m in said), said
    shards = params(gm)
    assert shards["transformer.wte.weight"].meta[META_SHARD] is None
    assert shards["transformer.h.0.mlp.c_fc.weight"].meta[META_SHARD] == COL
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten.cross_entropy_loss.default in targets
    assert torch.ops.autopart.vocab_parallel_ce.default not in targets
    # sequence parallelism around the whole vocabulary (refused before): the split starts
    # after the embedding and ends before the head, each once, and nothing else changes
    sp = _compile(case, 2, sequence_parallel=True)
    ops = torch.ops.autopart
    splits = [n for n in sp.graph.nodes if n.target == ops.tp_split.default]
    [join] = [n for n in sp.graph.nodes if n.target == ops.tp_join.default]
    assert [n.args[0].target for n in splits] == [torch.ops.aten.embedding.default] * 2
    assert splits[0].args[0].args[0].meta[META_INPUT].name == "transformer.wte.weight"
    assert [u.meta.get(META_ROLE) for u in join.users] == ["whole"]  # the LM head
    assert ops.vocab_parallel_ce.default not in {n.target for n in sp.graph.nodes}
    wte = params(sp)["transformer.wte.weight"]  # tied: read by the embedding and by the head
    # the split's all-gather backward gives every rank the whole table's gradient: no reduce
    assert ops.tp_all_reduce_grad.default not in {u.target for u in wte.users}
    wpe = params(sp)["transformer.wpe.weight"]  # cut by tp_split too: not reduced either
    assert ops.tp_all_reduce_grad.default not in {u.target for u in wpe.users}
    assert splits[1].args[0].args[0] is wpe


# -- a region the rules cannot prove stays replicated -----------------------------------------


class OddMLP(nn.Module):
    """An MLP that sorts (or prefix-sums) its hidden features: no split can pass that."""

    def __init__(self, mlp: nn.Module, op: str) -> None:
        super().__init__()
        self.c_fc, self.c_proj, self.op = mlp.c_fc, mlp.c_proj, op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x))
        h = torch.sort(h, dim=-1).values if self.op == "sort" else h.cumsum(-1)
        return self.c_proj(h)


@pytest.mark.parametrize("op", ["sort", "cumsum"])
def test_unprovable_region_falls_back_to_replicated(op: str, caplog) -> None:
    case = _with_mlp(lambda mlp: OddMLP(mlp, op))
    with caplog.at_level(logging.WARNING, logger="autopart"):
        gm = _compile(case, 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for layer, node in ((0, op), (1, f"{op}_1")):
        assert any(
            f"(transformer.h.{layer}.mlp.c_fc) replicated: {node} " in w
            and f"aten.{op}.default" in w
            for w in warnings
        ), warnings
    shards = {pattern(f): p.meta[META_SHARD] for f, p in params(gm).items()}
    for part in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"):
        assert shards[f"transformer.h.*.mlp.{part}"] is None
    # the attention regions and the vocabulary are still split
    assert shards["transformer.h.*.attn.c_attn.weight"] == TPShard(0, 3)
    assert shards["transformer.h.*.attn.c_proj.weight"] == ROW
    assert shards["transformer.wte.weight"] == TPShard(0)
    assert per_layer(calls(gm, ops.tp_reduce.default)) == {0: 1, 1: 1, None: 1}
    assert per_layer(calls(gm, ops.tp_copy.default)) == {0: 1, 1: 1, None: 1}
    assert torch.isfinite(run_local(case, gm, 2))


class ScanMLP(nn.Module):
    """An MLP whose hidden features are scanned along the sequence (dim 1) or stacked and
    unbound again: each feature on its own, so the split passes."""

    def __init__(self, mlp: nn.Module, op: str) -> None:
        super().__init__()
        self.c_fc, self.c_proj, self.op = mlp.c_fc, mlp.c_proj, op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x))
        if self.op == "unbind":
            a, b = torch.stack([h, 2 * h], 0).unbind(0)
            h = a - b / 4
        elif self.op in ("cummax", "cummin"):
            h = getattr(h, self.op)(1).values
        elif self.op == "cumprod":
            h = torch.sigmoid(h).cumprod(1)
        else:
            h = getattr(h, self.op)(1)
        return self.c_proj(h)


@pytest.mark.parametrize("op", ["cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "unbind"])
def test_a_scan_along_the_sequence_or_an_unbind_keeps_the_split(op: str) -> None:
    """Scans along the sequence and ``unbind`` of another dim left the MLP replicated ("no
    sharding rule"); they keep each feature apart, so the MLP splits (parity on real ranks:
    tests/test_parity_mixers.py, ``products``)."""
    case = _with_mlp(lambda mlp: ScanMLP(mlp, op))
    gm = _compile(case, 2)
    shards = {pattern(f): p.meta[META_SHARD] for f, p in params(gm).items()}
    assert shards["transformer.h.*.mlp.c_fc.weight"] == TPShard(0)
    assert shards["transformer.h.*.mlp.c_proj.weight"] == ROW
    assert torch.isfinite(run_local(case, gm, 2))


class UnevenQKV(nn.Module):
    """Grouped-query attention with one fused projection cut into q | k | v of unequal widths
    (4 query heads, 2 KV heads of 8): ``qkv(x).split([32, 16, 16])``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(32, 64), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([32, 16, 16], -1)
        q = q.view(b, s, 4, 8).transpose(1, 2)
        k, v = (
            t.view(b, s, 2, 8).transpose(1, 2)[:, :, None].expand(b, 2, 2, s, 8).reshape(b, 4, s, 8)
            for t in (k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, 32))


def test_a_fused_projection_of_unequal_parts_stays_replicated(caplog) -> None:
    """It refused the whole plan ("splits a tp-split tensor into unequal parts [16, 32]",
    naming no node: the eighteenth session's model probe); now its region stays replicated,
    named with the widths, and the MLPs are still split."""

    def make():
        model, batch = nanogpt.make()
        for block in model.transformer.h:
            block.attn = UnevenQKV()
        return model, batch

    with caplog.at_level(logging.WARNING, logger="autopart"):
        gm = _compile(_case(make), 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "(transformer.h.0.attn.qkv) replicated" in w and "unequal widths [16, 32]" in w
        for w in warnings
    ), warnings
    shards = {pattern(f): p.meta[META_SHARD] for f, p in params(gm).items()}
    assert shards["transformer.h.*.attn.qkv.weight"] is None
    assert shards["transformer.h.*.mlp.c_fc.weight"] == COL


class SquareTwice(nn.Module):
    """One square ``Linear`` applied twice, ``lin(gelu(lin(x)))``: a column matmul, then a row
    matmul, of the same weight."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        width = mlp.c_fc.in_features
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(F.gelu(self.lin(x)))


def test_a_weight_two_matmuls_would_split_two_ways_stays_replicated(caplog) -> None:
    """The weight would be split by its output features for one use and by its input features
    for the other: the whole plan was refused ("would be split two ways"), though a region
    is otherwise left replicated when it cannot be split (tp probe, seventeenth session). Its
    region stays replicated now, naming the weight; the attention is still split."""
    case = _with_mlp(SquareTwice)
    with caplog.at_level(logging.WARNING, logger="autopart"):
        gm = _compile(case, 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "the weight transformer.h.0.mlp.lin.weight would be split 2 ways (column and row" in w
        for w in warnings
    ), warnings
    shards = {pattern(f): p.meta[META_SHARD] for f, p in params(gm).items()}
    assert shards["transformer.h.*.mlp.lin.weight"] is None
    assert shards["transformer.h.*.attn.c_attn.weight"] == TPShard(0, 3)
    assert torch.isfinite(run_local(case, gm, 2))


class GainMLP(nn.Module):
    """An MLP whose split hidden features meet a replicated parameter: one gain for all of
    them (as Qwen3's per-head q/k norm weights meet the heads a rank holds)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.c_fc, self.c_proj = mlp.c_fc, mlp.c_proj
        self.gain = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)) * self.gain)


def test_a_replicated_parameter_inside_a_region_has_its_gradient_summed() -> None:
    """Each tp rank sees only its share of the features the gain multiplies, so the gain's
    gradient on a rank is a partial sum: the pass routes it through tp_all_reduce_grad (the
    region stays split). Without it, Qwen3's k_norm gradient was 97 % off under tp=2."""
    gm = _compile(_with_mlp(GainMLP), 2)
    by_name = params(gm)
    for layer in (0, 1):
        gain = by_name[f"transformer.h.{layer}.mlp.gain"]
        assert gain.meta[META_SHARD] is None
        assert [u.target for u in gain.users] == [ops.tp_all_reduce_grad.default]
        assert by_name[f"transformer.h.{layer}.mlp.c_fc.weight"].meta[META_SHARD] == COL
    # a parameter outside every region (a norm weight) gets no reduction
    assert all(
        u.target != ops.tp_all_reduce_grad.default
        for u in by_name["transformer.h.0.ln_1.weight"].users
    )


class FoldedHeads(nn.Module):
    """BLOOM's attention in small: a fused QKV viewed as [b, s, heads, 3, d], the heads folded
    into the batch for ``bmm``, a per-head ALiBi bias added to the folded scores, the causal
    mask added per head, the probabilities folded again, and the heads merged from
    ``view(b, heads, s, d)``. ``dropout``: the probabilities go through dropout."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb, self.qkv = nn.Embedding(50, 16), nn.Linear(16, 48)
        self.dense, self.head, self.dropout = nn.Linear(16, 16), nn.Linear(16, 50), dropout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.emb(ids)
        fused = self.qkv(x).view(b, s, 4, 3, 4)
        q, k, v = (fused[..., i, :].transpose(1, 2).reshape(b * 4, s, 4) for i in range(3))
        slopes = 2.0 ** -torch.arange(1, 5, dtype=x.dtype)
        alibi = (slopes[:, None] * torch.arange(s, dtype=x.dtype)[None, :])[:, None, :]
        scores = torch.bmm(q, k.transpose(1, 2)) * 0.5 + alibi.repeat(b, 1, 1)
        causal = torch.where(torch.ones(s, s, dtype=torch.bool).tril(), 0.0, -1e9).to(x.dtype)
        scores = scores.view(b, 4, s, s) + causal
        probs = F.dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
        y = torch.bmm(probs.view(b * 4, s, s), v).view(b, 4, s, 4)
        return self.head(x + self.dense(y.permute(0, 2, 1, 3).reshape(b, s, 16)))


def _folded_case(dropout: float) -> Case:
    def make():
        torch.manual_seed(0)
        model = FoldedHeads(dropout)
        ids = torch.randint(0, 50, (2, 16))
        return model.train(dropout > 0), (ids, ids)

    return _case(make)


def test_heads_folded_into_the_batch_split_by_heads(caplog) -> None:
    """Under tp (not Seq1F1B), an attention whose heads are folded into the batch (BLOOM)
    becomes SDPA over [b, heads, s, d] (canonicalize_attention's form 5, folded_only), so tp
    splits its heads: the fused QKV is column-split, the output projection row-split, each
    rank's per-head ALiBi mask its own heads' rows. Before, it stayed replicated ("view cannot
    keep dim 1 split"). With dropout on the probabilities it stays as the model wrote it
    (autopart's explicit dropout, not SDPA's), replicated, with a warning."""
    with caplog.at_level(logging.WARNING, logger="autopart"):
        gm = _compile(_folded_case(0.0), 2)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    shards = {f: p.meta[META_SHARD] for f, p in params(gm).items()}
    assert shards["qkv.weight"] == COL and shards["dense.weight"] == ROW
    (sdpa,) = calls(gm, aten.scaled_dot_product_attention.default)
    assert [int(d) for d in sdpa.args[0].meta["val"].shape[1:2]] == [2]  # 2 of the 4 heads
    assert calls(gm, aten.index_select.default)  # the mask's own heads
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autopart"):
        gm = _compile(_folded_case(0.1), 2)
    assert not calls(gm, aten.scaled_dot_product_attention.default)
    assert params(gm)["qkv.weight"].meta[META_SHARD] is None
    assert any("(qkv) replicated" in r.getMessage() for r in caplog.records)


@pytest.mark.multirank
def test_folded_heads_split_by_tp_match_one_device() -> None:
    """The split folded attention on 2 gloo ranks: loss and every gradient as on one device."""
    from autopart.parity.verify import Check, verify_many

    def make():
        torch.manual_seed(0)
        ids, labels = torch.randint(0, 50, (2, 2, 16))
        return FoldedHeads(), (ids, labels)

    (report,) = verify_many({"tp": Check(make, tp=2)}, via="fork", timeout_s=60).values()
    assert not isinstance(report, Exception) and report.ok, str(report)


class TimmAttention(nn.Module):
    """timm's (and many hand-written GPTs') attention: ``qkv(x).view(b, s, 3, heads, hd)``
    permuted to ``[3, b, heads, s, hd]`` and unbound into q, k, v, with q and k normalized
    (``F.normalize``: a vector norm expanded back)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv = nn.Embedding(50, 16), nn.Linear(16, 48)
        self.proj, self.head = nn.Linear(16, 16), nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.emb(ids)
        q, k, v = self.qkv(x).view(b, s, 3, 4, 4).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, s, 16)))


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_viewed_as_three_groups_of_heads_splits_strided(tp: int, caplog) -> None:
    """The view puts the split on the 3 of q, k, v, which tp does not divide: the attention
    stayed replicated ("unbinds the split dim"). Each group's heads split instead, the fused
    weight strided in 3 as for nanoGPT's ``split``; the 3 stays, the heads are divided (parity
    on real ranks: tests/test_parity_mixers.py, whose attention is this one)."""

    def make():
        torch.manual_seed(0)
        ids = torch.randint(0, 50, (2, 16))
        return TimmAttention(), (ids, ids)

    with caplog.at_level(logging.WARNING, logger="autopart"):
        gm = _compile(_case(make), tp)
    assert not [r.getMessage() for r in caplog.records if "(qkv) replicated" in r.getMessage()]
    shards = {f: p.meta[META_SHARD] for f, p in params(gm).items()}
    assert shards["qkv.weight"] == TPShard(0, 3) and shards["qkv.bias"] == TPShard(0, 3)
    assert shards["proj.weight"] == ROW
    (view,) = [n for n in calls(gm, aten.view.default) if len(n.args[1]) == 5]
    assert list(view.args[1])[2:] == [3, 4 // tp, 4]
    (sdpa,) = calls(gm, aten.scaled_dot_product_attention.default)
    assert int(sdpa.args[0].meta["val"].shape[1]) == 4 // tp
