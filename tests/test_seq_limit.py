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
from torch import nn

from autopart import Mesh, parallelize
from autopart.errors import AutopartError
from autopart.frontend.capture import capture
from autopart.frontend.shapes import longest_sequence
from autopart.layout import Plan
from autopart.program.format import load_rank, load_weights, read_head
from autopart.runtime.run import build_parser, check_args
from autopart.runtime.runner import Runner, make_groups

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
    its first length check, while 48 tokens train. An unlimited model (nanoGPT) gets None."""
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

    model, batch = nanogpt.make()
    assert longest_sequence(capture(model, batch).graph, tuple(batch[0].shape)) == (None, "")


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
