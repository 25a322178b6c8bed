"""The longest sequence a captured graph fits (frontend/shapes.longest_sequence, Plan.max_seq).

A model that slices a table of positions (GPT-1's ``position_ids`` buffer) fits no sequence
longer than its table, and torch.export may fix a size the example's length implied (a scan's
block count, when the example is shorter than one block). A longer step used to stop inside
every rank with torch's shape error; compile now finds the limit by fake propagation, warns with
the node, records it in the plan (kept in plan.json), and a longer sequence is refused before
any collective: by ``autopart run``'s checks and by the runner's step.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopart import Mesh, parallelize
from autopart.errors import AutopartError
from autopart.frontend.capture import capture
from autopart.frontend.loops import fixed_length
from autopart.frontend.shapes import longest_sequence, sequence_multiple
from autopart.layout import Plan
from autopart.program.format import load_rank, load_weights, read_head
from autopart.runtime.run import build_parser, check_args
from autopart.runtime.runner import Runner, local_weights, make_groups

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

TABLE = 48  # positions the toy model's table holds


class Tabled(nn.Module):
    """Token embeddings plus positions read from a buffer sliced to the length, as GPT-1 and
    other Hugging Face models keep ``position_ids``."""

    def __init__(self, vocab: int = 64, width: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(TABLE, width)
        self.register_buffer("positions", torch.arange(TABLE)[None], persistent=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        h = self.wte(input_ids) + self.wpe(self.positions[:, :s])
        return self.head(torch.tanh(h))


def _batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, 64, (2, seq), generator=g)
    return ids, ids.roll(-1, 1)


def test_a_position_table_limits_the_sequence_and_a_longer_step_is_refused(
    tmp_path: Path,
) -> None:
    """Captured at 16 tokens: the limit is the table's 48 (export bounds the length, since the
    slice of the table would be shorter beyond it); compile warns and sets Plan.max_seq, which plan.json
    keeps; autopart run's checks refuse --seq-len 56 and the runner refuses a 56-token step on
    its first length check, while 48 tokens train. A table read with ``arange(s)`` (nanoGPT)
    limits it too; rotary positions (Llama) leave it unlimited."""
    torch.manual_seed(0)
    model = Tabled()
    limit, why = longest_sequence(capture(model, _batch(16)).graph, (2, 16))
    assert (limit, why) == (
        TABLE,
        f"export bounds the length of input_ids to at most {TABLE} tokens",
    )
    with pytest.warns(UserWarning, match=f"fits sequences of at most {TABLE} tokens"):
        program = parallelize(model, Mesh(), example_inputs=_batch(16))
    assert program.plan.max_seq == TABLE
    folder = program.save(tmp_path / "p")
    head = read_head(folder)
    assert Plan.from_json(head["plan"]).max_seq == TABLE
    args = build_parser().parse_args([str(folder), "--seq-len", str(TABLE + 8)])
    with pytest.raises(AutopartError, match=f"--seq-len {TABLE + 8} is longer than the program"):
        check_args(args, head, Plan.from_json(head["plan"]))
    store = tmp_path / f"store-{uuid.uuid4().hex}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        plan = Plan.from_json(head["plan"])
        rp = load_rank(folder, 0)
        runner = Runner(rp, plan, load_weights(folder, 0, rp), make_groups(plan, 0, rp.ties))
        assert torch.isfinite(runner.step(*_batch(TABLE)))
        with pytest.raises(AutopartError, match=f"rank 0: a sequence of {TABLE + 8} tokens is"):
            runner.step(*_batch(TABLE + 8))
    finally:
        dist.destroy_process_group()
    import nanogpt

    # nanoGPT reads its table with arange(s), which export leaves unbounded and fake tensors
    # do not check: the positions are computed for real, and an index past the table's 64
    # rows is the limit (a 72-token step died in every rank with an index error)
    model, batch = nanogpt.make()
    limit, why = longest_sequence(capture(model, batch).graph, tuple(batch[0].shape))
    assert limit == model.config.block_size == 64, why
    assert "index 71 is out of range for the 64 rows of" in why and "embedding" in why
    from autopart.models import zoo

    model, batch = zoo.make("llama")  # rotary positions: no table, no limit
    assert longest_sequence(capture(model, batch).graph, tuple(batch[0].shape)) == (None, "")


class Masked(nn.Module):
    """nanoGPT's attention without flash: a causal mask buffer of ``TABLE`` rows sliced to the
    length (``bias[:, :, :s, :s]``), scores masked with it, heads merged with ``view``."""

    def __init__(self, vocab: int = 64, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        self.heads = heads
        self.register_buffer("bias", torch.tril(torch.ones(TABLE, TABLE))[None, None])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        x = self.wte(input_ids)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        att = (q @ k.transpose(-2, -1)).masked_fill(self.bias[:, :, :s, :s] == 0, float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).contiguous().view(b, s, -1)
        return self.head(x + self.proj(y))


class Fixed(nn.Module):
    """A learned table of positions added whole: the model takes ``TABLE`` tokens only."""

    def __init__(self, vocab: int = 64, width: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Parameter(torch.randn(TABLE, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.wte(input_ids) + self.wpe))


def _one_rank(tmp_path: Path, program) -> Runner:
    store = tmp_path / f"store-{uuid.uuid4().hex}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    rp = program.rank(0)
    weights = local_weights(program, rp)
    return Runner(rp, program.plan, weights, make_groups(program.plan, 0, rp.ties))


def test_an_example_longer_than_the_position_table_is_refused_at_compile() -> None:
    """nanoGPT with 16 positions captured at 32 tokens: torch.export's fake tensors do not
    check an index against its table, so the program was saved and every rank died in its
    first forward with an index error (seventeenth session). The positions, computed from the
    sizes alone, are looked up for real at the example's length: refused, naming the table."""
    from autopart.models import nanogpt

    model, (ids, labels) = nanogpt.make(n_layer=2, n_embd=8, n_head=2, block_size=16)
    ids, labels = torch.cat([ids, ids], 1), torch.cat([labels, labels], 1)  # 32 > 16 tokens
    with pytest.raises(IndexError):
        model(ids)  # one device refuses too
    with pytest.raises(AutopartError, match="does not run on its own example") as err:
        parallelize(model, Mesh(), example_inputs=(ids, labels))
    assert "index 31 is out of range for the 16 rows of transformer_wpe_weight" in err.value.message
    assert "(module transformer.wpe)" in err.value.message
    assert "no longer than the model's table of positions" in (err.value.hint or "")


def test_a_mask_table_as_long_as_the_example_keeps_the_length_symbolic(tmp_path: Path) -> None:
    """Captured at the mask table's own length, the slice is the whole table and export fixes
    the length to it: a shorter step then failed inside every rank with a shape error. Capture
    now takes the model once more at a shorter length, where the length stays symbolic
    (bounded by the table): the program trains 48, 40 and 17 tokens with the model's loss and
    gradients (float64, one rank), and refuses 56. With no example batch, parallelize's made-up
    one (64 tokens) is too long for the table, and half of it is taken."""
    torch.manual_seed(0)
    model = Masked().double()
    assert fixed_length(capture(model, _batch(TABLE), roll=False).graph) == TABLE  # export's
    captured = capture(model, _batch(TABLE))
    assert fixed_length(captured.graph) is None and captured.example_shape == (2, TABLE)
    with pytest.warns(UserWarning, match=f"fits sequences of at most {TABLE} tokens"):
        program = parallelize(captured, Mesh())
        # the second capture's length keeps the example's divisibility (an odd one broke SP)
        parallelize(captured, Mesh(tp=2), sequence_parallel=True)
        # no example: 64 made-up tokens overrun the table (its size is in no config), 32 fit
        made = parallelize(model, Mesh())
    assert made.example_shape == (1, 32) and made.plan.max_seq == TABLE
    assert (program.plan.min_seq, program.plan.max_seq) == (None, TABLE)
    runner = _one_rank(tmp_path, program)
    try:
        for seq in (TABLE, 40, 17):
            ids, labels = _batch(seq)
            model.zero_grad()
            want = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
            want.backward()
            got = runner.step(ids, labels)
            assert torch.allclose(got, want, rtol=1e-12, atol=0), (seq, got, want)
            for f, p in runner.named_parameters():
                ref = model.get_parameter(f).grad
                assert torch.allclose(p.grad, ref, rtol=1e-9, atol=1e-12), (seq, f)
        with pytest.raises(AutopartError, match=f"a sequence of {TABLE + 8} tokens is longer"):
            runner.step(*_batch(TABLE + 8))
    finally:
        dist.destroy_process_group()


def test_a_graph_of_one_length_refuses_another(tmp_path: Path) -> None:
    """A model that adds a whole table of positions takes its table's length only: compile
    warns "exactly 48 tokens" naming the node, sets Plan.min_seq = max_seq = 48 (kept in
    plan.json), and a shorter sequence is refused by autopart run's checks and by the runner
    before any collective, where it used to fail inside every rank; 48 tokens train."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=f"fits sequences of exactly {TABLE} tokens \\(at 24"):
        program = parallelize(Fixed(), Mesh(), example_inputs=_batch(TABLE))
    assert (program.plan.min_seq, program.plan.max_seq) == (TABLE, TABLE)
    folder = program.save(tmp_path / "p")
    head = read_head(folder)
    assert Plan.from_json(head["plan"]).min_seq == TABLE
    args = build_parser().parse_args([str(folder), "--seq-len", "16"])
    with pytest.raises(AutopartError, match="--seq-len 16 is shorter than the program"):
        check_args(args, head, Plan.from_json(head["plan"]))
    runner = _one_rank(tmp_path, program)
    try:
        assert torch.isfinite(runner.step(*_batch(TABLE)))
        with pytest.raises(AutopartError, match="rank 0: a sequence of 16 tokens is shorter"):
            runner.step(*_batch(16))
    finally:
        dist.destroy_process_group()
    with pytest.raises(AutopartError, match="no sequence fits"):
        Plan(Mesh(), min_seq=64, max_seq=48)


class Pairs(nn.Module):
    """Mixes each pair of adjacent tokens (``reshape(b, s // 2, 2 * d)``): export keeps the
    length symbolic with no guard, yet only even lengths fit."""

    def __init__(self, vocab: int = 64, width: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.mix = nn.Linear(2 * width, 2 * width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(input_ids)
        b, s, d = h.shape
        return self.head(h + self.mix(h.reshape(b, s // 2, 2 * d)).reshape(b, s, d))


def test_a_graph_of_even_lengths_refuses_an_odd_one(tmp_path: Path) -> None:
    """A model that cuts the sequence into pairs fits even lengths only: compile warns "a
    multiple of 2 tokens" naming the reshape that fails at 15 tokens, and raises
    Plan.seq_block to 2; autopart run's checks and the runner refuse 15 tokens before any
    collective, where the step used to fail inside every rank with torch's shape error. 14
    and 16 tokens train, equal to the model on one device. (Graphs that divide no size by a
    constant pay no propagation: nanoGPT, below.)"""
    torch.manual_seed(0)
    model = Pairs().double()
    with pytest.warns(UserWarning, match="a multiple of 2 tokens \\(at 15 tokens, node %reshape"):
        program = parallelize(model, Mesh(), example_inputs=_batch(16))
    assert program.plan.seq_block == 2 and program.plan.min_seq is None
    folder = program.save(tmp_path / "p")
    head = read_head(folder)
    args = build_parser().parse_args([str(folder), "--seq-len", "15"])
    with pytest.raises(AutopartError, match="--seq-len 15 is not a multiple of 2 tokens"):
        check_args(args, head, Plan.from_json(head["plan"]))
    runner = _one_rank(tmp_path, program)
    try:
        for seq in (14, 16):
            ids, labels = _batch(seq)
            want = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
            assert abs(runner.step(ids, labels).item() - want.item()) <= 1e-12 * want.item()
        with pytest.raises(AutopartError, match="rank 0: a sequence of 15 tokens is not a mul"):
            runner.step(*_batch(15))
    finally:
        dist.destroy_process_group()
    import nanogpt

    model, batch = nanogpt.make()
    assert sequence_multiple(capture(model, batch).graph, tuple(batch[0].shape)) == (1, "")


def test_max_seq_in_plan_json_is_checked() -> None:
    """A plan.json max_seq must be a positive integer or null, like every plan field."""
    for bad in (0, -8, 1.5, "64", True):
        with pytest.raises(AutopartError, match="max_seq"):
            Plan(Mesh(), max_seq=bad)
    assert Plan(Mesh(), max_seq=None).max_seq is None


@pytest.mark.slow  # a Hugging Face hybrid: about 10 s
def test_a_size_export_fixed_is_found_by_fake_propagation() -> None:
    """Nemotron-H with Mamba-2 blocks of 128 tokens, captured at 32 (less than one block):
    export leaves the length unbounded but writes the cross-block size as a number, so the
    graph fits 128 tokens and not 136. The bisection finds 128 and names the expand."""
    from autopart.models import zoo

    model, batch = zoo.make("nemotron_h", chunk_size=128)
    limit, why = longest_sequence(capture(model, batch).graph, tuple(batch[0].shape))
    assert limit == 128 and why.startswith("at 136 tokens, node %expand"), why
    assert "(module model.layers.0.mixer)" in why, why


class _LengthNumber(nn.Module):
    """A float computed from a size and handed to an op as a number: the attention's scale from
    the length (``scale = 4 / s``), a norm's eps from the length, or (``batch``) a scale from
    the batch size."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.qkv, self.head = nn.Embedding(64, 16), nn.Linear(16, 48), nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.emb(ids)
        if self.kind == "eps":
            x = F.layer_norm(x, (16,), eps=8.0 / s)
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        scale = {"scale": 4.0 / s, "batch": 1.0 / b}.get(self.kind)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.head(y.transpose(1, 2).reshape(b, s, 16))


@pytest.mark.parametrize("kind", ["scale", "eps"])
def test_a_number_computed_from_the_length_fixes_it(kind: str) -> None:
    """torch.export keeps a float computed from the length as the example's value (``scale:
    0.125``) with a guard, not a fixed length: a 16-token step of a program captured at 32 ran
    with the 32-token scale, silently (loss 4e-4 off; mixer probe, seventeenth session). The
    guard now fixes the length, naming the number, and a step of another is refused."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"exactly 32 tokens \(the model computes a number from"):
        program = parallelize(_LengthNumber(kind).double(), Mesh(), example_inputs=_batch(32))
    assert program.plan.min_seq == program.plan.max_seq == 32
    assert parallelize(_LengthNumber("none").double(), Mesh(), example_inputs=_batch(32)).plan == (
        Plan(Mesh())
    )


def test_a_number_computed_from_the_batch_size_is_refused() -> None:
    """The same from the batch size: a micro-batch or a dp share runs on fewer rows."""
    with pytest.raises(AutopartError, match="computes a number from the batch size") as err:
        capture(_LengthNumber("batch").double(), _batch(32))
    assert "1.0/b = 0.5" in err.value.message
