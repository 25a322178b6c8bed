"""Bad data never trains silently: token ids and labels outside the vocabulary are refused at
the step on every rank (naming the value and its position), under tp=1 and tp=2 (where the
vocabulary-parallel embedding used to zero such an id and train on), and a non-finite loss
stops the step before any optimizer could use its gradients. Real forked gloo ranks."""

from __future__ import annotations

import pytest
import torch
from conftest import nanogpt

from autopart import AutopartError, Mesh, parallelize
from autopart.parity.checks import fork_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def programs():
    model, batch = nanogpt.make()
    model = model.double()
    return {
        "tp1": parallelize(model, Mesh(dp=2), example_inputs=batch, microbatches=2),
        "tp2": parallelize(model, Mesh(tp=2), example_inputs=batch),
    }, batch


@pytest.mark.parametrize("mesh", ["tp1", "tp2"])
@pytest.mark.parametrize(
    ("which", "value"), [("input_ids", 96), ("input_ids", -1), ("labels", 96), ("labels", -7)]
)
def test_ids_and_labels_outside_the_vocabulary_are_refused(programs, mesh, which, value, tmp_path):
    progs, (ids, labels) = programs
    ids, labels = ids.clone(), labels.clone()
    (ids if which == "input_ids" else labels)[5, 7] = value
    with pytest.raises(AutopartError) as err:
        fork_ranks(progs[mesh], (ids, labels), tmp_path, timeout_s=60)
    assert f"{which}[5, 7] = {value} is outside the vocabulary of 96 tokens" in err.value.message


def test_a_non_finite_loss_stops_the_step(programs, tmp_path):
    progs, batch = programs
    program = progs["tp1"]
    wte = program.params["transformer.wte.weight"]
    saved = wte.detach().clone()
    with torch.no_grad():  # finite weights (a NaN weight is refused before the step, see
        # test_launch.py), whose forward overflows: the loss is not finite
        wte[batch[0][3, 2]] = torch.finfo(wte.dtype).max
    try:
        with pytest.raises(AutopartError) as err:
            fork_ranks(program, batch, tmp_path, timeout_s=60)
    finally:
        with torch.no_grad():
            wte.copy_(saved)
    assert "step 1: the loss is nan, not finite" in err.value.message
    assert "no optimizer steps on them" in err.value.message
    assert not list(tmp_path.glob("rank*.pt"))  # no rank dumped (saved) anything


def test_a_sequence_longer_than_the_position_table_is_named(tmp_path):
    """nanoGPT's learned positions hold 64 rows: 72 tokens used to be a raw IndexError inside a
    rank. An example that long is now refused at compile (the model fails on it); positions
    from the batch past a table, which no compile can see, stop the step with an error naming
    the rank, the action and the length."""
    model, _ = nanogpt.make()
    ids = torch.randint(0, 96, (2, 72))
    labels = ids.roll(-1, 1)  # nanoGPT's labels: the next tokens
    with pytest.raises(AutopartError, match="does not run on its own example"):
        parallelize(model, Mesh(pp=2), example_inputs=(ids, labels))
    from autopart.runtime.runner import Runner, local_weights

    torch.manual_seed(0)
    table = _PositionsGiven()
    ids = torch.randint(0, 96, (2, 16))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": torch.arange(16)[None]}
    program = parallelize(
        table, Mesh(), example_inputs={**batch, "position_ids": batch["position_ids"].expand(2, -1)}
    )
    rp = program.rank(0)
    runner = Runner(rp, program.plan, local_weights(program, rp), {})
    with pytest.raises(AutopartError) as err:
        runner.step(ids, batch["labels"], position_ids=torch.full_like(ids, 40))
    assert "an index out of range in the model" in err.value.message, err.value.message


class _PositionsGiven(torch.nn.Module):
    """Learned positions for 32 tokens, read at the batch's ``position_ids``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(96, 16), torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 96)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.wte(input_ids) + self.wpe(position_ids)))


def test_micro_batch_1_is_captured_and_trains_exactly():
    """An example of one sequence (micro-batch 1, as the largest runs use) is traced as two
    copies, so the batch stays symbolic; pp=2 then matches one device in float64."""
    from autopart.parity.verify import Check, verify_many

    def one():
        model, (ids, labels) = nanogpt.make()
        return model, (ids[:1].clone(), labels[:1].clone())

    (report,) = verify_many([Check(one, pp=2)], via="fork", timeout_s=60).values()
    assert not isinstance(report, AutopartError), report
    assert report.ok and report.tolerance == 1e-9, str(report)


def test_a_token_file_with_an_id_outside_the_vocabulary_is_refused_before_training(tmp_path):
    import argparse

    from autopart.runtime.run import Batches

    tokens = torch.randint(0, 96, (500,))
    tokens[321] = 4000
    torch.save(tokens, tmp_path / "tokens.pt")
    args = argparse.Namespace(
        batch_size=None, seq_len=None, seed=0, batch=None, tokens=tmp_path / "tokens.pt"
    )
    with pytest.raises(AutopartError) as err:
        Batches(args, {"example_shape": [8, 32], "vocab_size": 96})
    assert "token 321 is 4000, outside the model's vocabulary of 96" in err.value.message
