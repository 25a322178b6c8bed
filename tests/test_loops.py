"""Loops over the tokens (``autopart/frontend/loops.py``, ``autopart/scan.py``): a model whose
Python loop over its tokens export unrolls at the example's length is rolled back up at
capture (a linear recurrence becomes ``autopart::linear_scan``, the per-token work one
vectorized computation), fits any length, and chunks exactly under Seq1F1B with the scan's
state carried; negative controls — a recurrence that is not linear, per-token work that reads
the next token — keep export's fixed length, and Seq1F1B refuses them, naming it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import rel_err, run_graph, run_model
from torch import nn

from autopart import Mesh, parallelize
from autopart.errors import AutopartError
from autopart.frontend.capture import capture
from autopart.meta import META_INPUT

sys.path.insert(0, str(Path(__file__).resolve().parent / "passes"))
from test_sequence_chunk import _chunked_exactly  # noqa: E402

SCAN = torch.ops.autopart.linear_scan.default
CUTS = ((6, 10), (1, 7, 8), (4, 4, 4, 4))


class _Loop(nn.Module):
    """Embeddings, a gate a_t = sigmoid(W x_t) in (0, 1), the recurrence h_t = a_t · h_{t−1} +
    x_t run by a Python loop over the tokens (as Hugging Face Mamba runs its selective scan),
    each token's output h_t · c_t, and a head. ``kind``: "linear" (rolled up), "flat" (the
    tokens flattened through the head: views sized by the width and the length), "gated"
    (h_t = tanh(a_t · h_{t−1} + x_t): not linear), "ahead" (h_t · c_{t+1}: reads the next
    token), "collect" (each output written into a buffer, ``out[:, t] = …``, as RecurrentGemma
    does, and the tokens flattened with the batch, ``reshape(b · s, width)``), "collect-gap"
    (the buffer's last entry never written: it is not the outputs stacked), "cast" (the
    recurrence run in float32, its tokens cast one by one: ``a[:, t].float()``), "masked" (then
    an attention masked by a buffer cut to the length, ``mask[:, :s, :s]``, as nanoGPT's),
    "scaled" (the outputs times the max of a buffer's first ``width`` entries)."""

    def __init__(self, kind: str, width: int = 8) -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.gate = nn.Embedding(50, width), nn.Linear(width, width)
        self.c, self.out = nn.Linear(width, width), nn.Linear(width, 50)
        if kind == "masked":  # nanoGPT's causal mask, a buffer longer than the sequence
            self.register_buffer("mask", torch.tril(torch.ones(64, 64)).view(1, 64, 64))
        if kind == "scaled":  # a table read to the width: its max is entry 0 up to 24, then 5
            scale = torch.cat([torch.ones(1), torch.rand(23) * 0.5, 5 + torch.rand(40)])
            self.register_buffer("scale", scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        a, c = torch.sigmoid(self.gate(x)), self.c(x)
        h = torch.zeros_like(x[:, 0], dtype=torch.float32 if self.kind == "cast" else None)
        outs, buffer = [], torch.zeros_like(x)
        b, s = ids.shape
        for t in range(s):
            if self.kind == "cast":
                h = a[:, t].float() * h + x[:, t].float()
                outs.append(h.to(x.dtype) * c[:, t])
                continue
            h = a[:, t] * h + x[:, t]
            if self.kind == "gated":
                h = torch.tanh(h)
            outs.append(h * c[:, min(t + 1, s - 1) if self.kind == "ahead" else t])
            if self.kind == "collect" or (self.kind == "collect-gap" and t < s - 1):
                buffer[:, t] = outs[-1]
        if self.kind.startswith("collect"):
            y = (buffer + x).reshape(b * s, x.shape[-1])
            return self.out(y).view(b, s, 50)
        y = torch.stack(outs, dim=1) + x
        if self.kind == "scaled":
            y = y * self.scale[: x.shape[-1]].max()
        if self.kind == "masked":  # attention by its mask cut to the length, [:, :s, :s]
            scores = (y @ y.transpose(1, 2)).masked_fill(self.mask[:, :s, :s] == 0, -torch.inf)
            y = y + scores.softmax(-1) @ y
        if self.kind == "flat":  # tokens flattened: a view [-1, width], then [b, s, 50]
            return self.out(y.reshape(-1, y.shape[-1])).view(ids.shape[0], ids.shape[1], 50)
        return self.out(y)


def test_a_loop_over_the_tokens_is_rolled_up_and_fits_any_length() -> None:
    """One ``linear_scan``, no per-token nodes; input_ids' length is symbolic again, and at 24
    tokens (captured at 16) the graph's loss and every gradient are the model's."""
    model = _Loop("linear").double()
    ids = torch.randint(1, 50, (2, 16))
    captured = capture(model, (ids, ids))
    assert captured.loops == "rolled up"
    nodes = list(captured.graph.graph.nodes)
    assert sum(n.target == SCAN for n in nodes) == 1
    assert not any(n.target == torch.ops.aten.stack.default for n in nodes)
    (ids_node,) = [n for n in nodes if getattr(n.meta.get(META_INPUT), "name", "") == "input_ids"]
    assert isinstance(ids_node.meta["val"].shape[1], torch.SymInt)
    longer = torch.randint(1, 50, (2, 24))
    want, want_grads = run_model(model, (longer, longer))
    got, grads = run_graph(captured, (longer, longer))
    assert rel_err(got, want) <= 1e-12
    assert all(rel_err(grads[f], want_grads[f]) <= 1e-10 for f in want_grads)


@pytest.mark.slow  # suite time: two captures and six runs of the model (9 s)
def test_a_length_equal_to_a_width_is_captured_again_at_a_free_one() -> None:
    """16 tokens and a width of 16: the view [-1, 16] reads as [-1, s], the rolled graph fails
    at 24 tokens, so capture exports again at a length no size of the graph has and rolls that
    up: it then matches the model at 40 tokens."""
    model = _Loop("flat", width=16).double()
    ids = torch.randint(1, 50, (2, 16))
    captured = capture(model, (ids, ids))
    assert captured.loops == "rolled up" and captured.example_shape == (2, 16)
    longer = torch.randint(1, 50, (2, 40))
    want, _ = run_model(model, (longer, longer))
    got, _ = run_graph(captured, (longer, longer))
    assert rel_err(got, want) <= 1e-12


def test_a_rolled_loop_chunks_exactly_with_its_state_carried() -> None:
    """Seq1F1B: the scan gets the previous chunk's last state as a ``kv`` carry (empty for the
    first chunk) and hands on its own; three cuts, one of a single token."""
    _, gm = _chunked_exactly(_Loop("linear"), torch.randint(1, 50, (2, 16)), CUTS)
    (scan,) = [n for n in gm.graph.nodes if n.target == SCAN]
    carry = scan.args[3]
    assert carry.op == "placeholder" and carry.meta[META_INPUT].kind == "kv"


def test_a_mask_buffer_cut_to_the_length_is_cut_to_any_length() -> None:
    """A token loop beside nanoGPT's attention, whose causal mask is a buffer longer than the
    sequence cut to it (``mask[:, :s, :s]``): export wrote the cut as ``:16`` and the rolled
    graph failed at other lengths, so the loop stayed unrolled and Seq1F1B refused the model
    (the twenty-fifth session's probe, Griffin's RG-LRU beside nanoGPT attention). The cut
    reads the length now: rolled up, and chunked exactly."""
    model = _Loop("masked")
    captured, _ = _chunked_exactly(model, torch.randint(1, 50, (2, 16)), CUTS)
    assert captured.loops == "rolled up"


def test_a_table_cut_to_a_width_equal_to_the_length_keeps_the_width() -> None:
    """16 tokens and a width of 16: ``scale[:16].max()`` reads the width. Cutting every
    buffer to the length at once made it ``scale[:s]``, which the check at 16, 24 and 8 tokens
    could not tell (the max of the first 24 entries is the max of the first 8), and at 32
    tokens the loss was 2.0 off (the twenty-fifth session's probe of its own change). Buffers
    are cut to the length only at a length no width has; here the slice keeps 16."""
    model = _Loop("scaled", width=16).double()
    ids = torch.randint(1, 50, (2, 16))
    captured = capture(model, (ids, ids))
    assert captured.loops == "rolled up"
    longer = torch.randint(1, 50, (2, 40))
    want, _ = run_model(model, (longer, longer))
    got, _ = run_graph(captured, (longer, longer))
    assert rel_err(got, want) <= 1e-12


@pytest.mark.slow  # suite time (11 s): the matrix's RecurrentGemma row casts its tokens too
def test_a_recurrence_of_cast_tokens_scans_the_cast_tensors() -> None:
    """Each token cast to float32 before the step (RecurrentGemma's RG-LRU in a float64
    model): one scan of the cast tensors, matching the model at 24 tokens to float32's
    rounding."""
    model = _Loop("cast").double()
    ids = torch.randint(1, 50, (2, 16))
    captured = capture(model, (ids, ids))
    assert captured.loops == "rolled up"
    (scan,) = [n for n in captured.graph.graph.nodes if n.target == SCAN]
    assert all(x.meta["val"].dtype == torch.float32 for x in scan.args[:2])
    longer = torch.randint(1, 50, (2, 24))
    want, _ = run_model(model, (longer, longer))
    got, _ = run_graph(captured, (longer, longer))
    assert rel_err(got, want) <= 1e-6


def test_outputs_written_into_a_buffer_are_rolled_up_and_chunk_exactly() -> None:
    """RecurrentGemma's form: ``out[:, t] = h_t · c_t`` for every t (a chain of
    ``select_scatter``) is the outputs stacked, and a view of b · S rows (the batch times the
    fixed length, one size node) takes b · s: rolled up, the graph matches the model at 24
    tokens (captured at 16), and it chunks exactly with the state carried."""
    model = _Loop("collect").double()
    ids = torch.randint(1, 50, (2, 16))
    captured = capture(model, (ids, ids))
    assert captured.loops == "rolled up"
    nodes = list(captured.graph.graph.nodes)
    assert not any(n.target == torch.ops.aten.select_scatter.default for n in nodes)
    longer = torch.randint(1, 50, (2, 24))
    want, _ = run_model(model, (longer, longer))
    got, _ = run_graph(captured, (longer, longer))
    assert rel_err(got, want) <= 1e-12
    _chunked_exactly(_Loop("collect"), ids, CUTS[:2])


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("gated", "no loop over the tokens that autopart recognizes"),
        ("ahead", "reads"),
        pytest.param(  # suite time (15 s)
            "collect-gap",
            "no loop over the tokens that autopart recognizes",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_loops_that_are_not_linear_recurrences_keep_their_fixed_length(kind: str, why: str) -> None:
    """Negative controls: not rolled up (the reason kept on the capture), and Seq1F1B refuses
    the fixed length before any rank starts."""
    ids = torch.randint(1, 50, (2, 16))
    captured = capture(_Loop(kind).double(), (ids, ids))
    assert why in captured.loops
    with pytest.raises(AutopartError) as err:
        parallelize(captured, Mesh(), schedule="seq1f1b", seq_chunks=2)
    assert "fixed at capture to 16 tokens" in err.value.message
    assert f"could not write the graph for any length: {captured.loops}" in err.value.message


def test_the_scan_op_is_the_loop_and_its_gradient() -> None:
    """``linear_scan`` forward: the same bits as the loop; backward: gradcheck, from zeros and
    from a carried state (and from an empty one)."""
    torch.manual_seed(0)
    a = torch.rand(2, 3, 7, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 3, 7, 4, dtype=torch.float64, requires_grad=True)
    init = torch.randn(2, 3, 1, 4, dtype=torch.float64, requires_grad=True)
    h, outs = init[:, :, -1], []
    for i in range(7):
        h = a[:, :, i] * h + b[:, :, i]
        outs.append(h)
    assert torch.equal(SCAN(a, b, 2, init), torch.stack(outs, 2))
    empty = torch.zeros(2, 3, 0, 4, dtype=torch.float64, requires_grad=True)
    for start in (init, empty):
        assert torch.autograd.gradcheck(lambda a, b, i: SCAN(a, b, 2, i), (a, b, start))
    assert torch.autograd.gradcheck(lambda a, b: SCAN(a, b, 2), (a, b))
