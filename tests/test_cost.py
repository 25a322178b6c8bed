"""cost.analyze(): symbolic FLOPs per node and per group, checked against closed forms."""

from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F
from conftest import Case
from torch import fx, nn

from autopart.frontend.capture import B, S, capture
from autopart.frontend.cost import Cost, analyze, evaluate, node_cost, total
from autopart.meta import META_COST


def _op(node: fx.Node) -> str:
    return getattr(node.target, "_opname", getattr(node.target, "__name__", ""))


def _dims(case: Case) -> tuple[int, int, int, int]:
    cfg = case.model.config
    return cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.n_head


def _closed_form(n_layer: int, h: int, v: int) -> sympy.Expr:
    # 12·h² weights per block (QKV 3h², proj h², MLP 8h²) + the LM head, 2 FLOPs per MAC,
    # plus causal attention: QKᵀ and AV over half the (s × s) square, 4·b·h·s²/2 per layer.
    return 2 * B * S * (12 * n_layer * h**2 + v * h) + n_layer * 2 * B * S**2 * h


def test_total_mm_flops_closed_form(gpt_sdpa: Case) -> None:
    n_layer, h, v, _ = _dims(gpt_sdpa)
    groups = analyze(gpt_sdpa.captured)
    mm = total(g.cost for g in groups).mm_flops
    expect = _closed_form(n_layer, h, v)
    assert sympy.expand(mm - expect) == 0
    assert mm.free_symbols <= {B, S}
    for b, s in [(8, 32), (3, 17), (1, 1024)]:
        want = 2 * b * s * (12 * n_layer * h * h + v * h) + n_layer * 2 * b * s * s * h
        assert evaluate(mm, b, s) == want


def test_groups_in_order_with_params(gpt_sdpa: Case) -> None:
    n_layer, h, v, _ = _dims(gpt_sdpa)
    groups = analyze(gpt_sdpa.captured)
    assert [g.name for g in groups] == ["embed", *(f"block {i}" for i in range(n_layer)), "head"]
    assert [g.layer for g in groups] == [None, *range(n_layer), None]
    model = gpt_sdpa.model
    assert sum(g.params for g in groups) == sum(p.numel() for p in model.parameters())
    cfg = model.config
    assert groups[0].params == (cfg.vocab_size + cfg.block_size) * h  # wte (tied, once) + wpe
    per_block = sum(p.numel() for p in model.transformer.h[0].parameters())
    assert all(g.params == per_block for g in groups[1:-1])
    assert groups[-1].params == 2 * h  # ln_f only: lm_head's weight is wte's, counted in embed
    assert sympy.expand(groups[-1].cost.mm_flops - 2 * B * S * v * h) == 0
    assert groups[0].cost.mm_flops == 0
    for g in groups[1:-1]:
        assert sympy.expand(g.cost.mm_flops - (24 * B * S * h**2 + 2 * B * S**2 * h)) == 0
    names = [n for g in groups for n in g.nodes]
    calls = [n.name for n in gpt_sdpa.captured.graph.graph.nodes if n.op == "call_function"]
    assert names == calls  # every call node in exactly one group, graph order kept


def test_every_call_node_has_a_cost(gpt_sdpa: Case) -> None:
    analyze(gpt_sdpa.captured)
    for n in gpt_sdpa.captured.graph.graph.nodes:
        if n.op == "call_function":
            cost = n.meta[META_COST]
            assert isinstance(cost, Cost)
            assert cost.mm_flops == 0 or _op(n) in ("linear", "scaled_dot_product_attention")
            assert sympy.simplify(cost.flops - cost.mm_flops).free_symbols <= {B, S}
            if _op(n) in ("view", "transpose", "split", "getitem", "embedding", "sym_size"):
                assert cost.flops == 0


def test_causal_sdpa_counts_half_the_square(gpt_sdpa: Case) -> None:
    _, h, _, n_head = _dims(gpt_sdpa)
    gm = gpt_sdpa.captured.graph
    nodes = [n for n in gm.graph.nodes if _op(n) == "scaled_dot_product_attention"]
    assert len(nodes) == 2
    d = h // n_head
    for n in nodes:
        assert sympy.expand(node_cost(n, gm).mm_flops - 4 * B * n_head * d * S**2 / 2) == 0


class _FullAttention(nn.Module):
    """One bidirectional attention layer: SDPA without is_causal."""

    def __init__(self, vocab: int = 16, h: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, s, h = x.shape
        q = x.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q)
        return self.head(y.transpose(1, 2).reshape(b, s, h))


def test_non_causal_sdpa_counts_the_full_square() -> None:
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    cap = capture(_FullAttention(), (ids, ids))
    gm = cap.graph
    (node,) = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    cost = node_cost(node, gm)
    assert sympy.expand(cost.mm_flops - 4 * B * 2 * 4 * S**2) == 0  # b·heads·d·s·s·4
    assert sympy.expand(cost.flops - cost.mm_flops - 3 * B * 2 * S**2) == 0
    groups = analyze(cap)
    assert [g.name for g in groups] == ["embed"]  # no blocks: everything is the embed group
    assert sympy.expand(groups[0].cost.mm_flops - (4 * B * 8 * S**2 + 2 * B * S * 8 * 16)) == 0


def _sdpa_graph(op, *args) -> tuple[fx.GraphModule, fx.Node]:
    """A one-node graph calling ``op(q, k, v, *args)`` with meta values (b=2, heads=4, s=8, d=16)."""
    g = fx.Graph()
    qkv = []
    for name in "qkv":
        p = g.placeholder(name)
        p.meta["val"] = torch.empty(2, 4, 8, 16, device="meta")
        qkv.append(p)
    node = g.call_function(op, (*qkv, *args))
    node.meta["val"] = torch.empty(2, 4, 8, 16, device="meta")
    g.output(node)
    return fx.GraphModule(nn.Module(), g), node


def test_sdpa_is_causal_positional() -> None:
    gm, node = _sdpa_graph(torch.ops.aten.scaled_dot_product_attention.default, None, 0.0, True)
    assert node_cost(node, gm).mm_flops == 4 * 2 * 4 * 16 * (64 - 32)
    gm, node = _sdpa_graph(torch.ops.aten.scaled_dot_product_attention.default)
    assert node_cost(node, gm).mm_flops == 4 * 2 * 4 * 16 * 64


def test_flash_attention_is_causal_positional() -> None:
    op = torch.ops.aten._scaled_dot_product_flash_attention.default
    gm, node = _sdpa_graph(op, 0.0, True)
    assert node_cost(node, gm).mm_flops == 4 * 2 * 4 * 16 * (64 - 32)


def test_cost_add_and_total() -> None:
    a = Cost(B, B, 2 * B, S)
    c = a + Cost(S, 0, 1, 1)
    assert c.astuple() == (B + S, B, 2 * B + 1, S + 1)
    assert total([a, a, a]).flops == 3 * B
    assert total([]) == Cost()
    assert evaluate(B * S**2, 2, 3) == 18.0
