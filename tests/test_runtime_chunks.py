"""The runtime's Seq1F1B chunking on one rank (pp = 1: no process group is needed): parity with
the model, and clear errors for sequences the plan's chunks do not fit."""

from __future__ import annotations

import nanogpt
import pytest
from conftest import rel_err, run_model

from autopart import Mesh, parallelize
from autopart.errors import AutopartError
from autopart.runtime.runner import Runner


def _runner(k: int, split: str = "balanced", **kw) -> tuple[Runner, tuple]:
    model, batch = nanogpt.make_long(**kw)
    model = model.double()
    prog = parallelize(
        model,
        Mesh(),
        example_inputs=batch,
        schedule="seq1f1b",
        seq_chunks=k,
        seq_split=split,
        microbatches=2,
    )
    rp = prog.rank(0)
    weights = {f: rp.shards[f].local(t.detach().clone()) for f, t in prog.params.items()}
    return Runner(rp, prog.plan, {**weights, **prog.buffers}, {}), (model, batch)


@pytest.mark.parametrize(("k", "split"), [(2, "balanced"), (4, "balanced"), (4, "uniform")])
def test_one_rank_chunked_step_matches_the_model(k: int, split: str) -> None:
    runner, (model, batch) = _runner(k, split)
    loss = runner.step(*batch)
    want_loss, want = run_model(model, batch)
    count = (batch[1] != -100).sum()
    assert rel_err(loss, want_loss / count) <= 1e-12
    for fqn, p in runner.named_parameters():
        assert rel_err(p.grad, want[fqn] / count) <= 1e-12, fqn
    lengths = [e - a for a, e in runner._chunk_bounds(batch[0].shape[1])]
    assert sum(lengths) == 256 and len(lengths) == k
    assert (lengths[0] > lengths[-1]) == (split == "balanced")  # later chunks attend further


def test_sequences_the_chunks_do_not_fit_are_refused() -> None:
    runner, (_, (ids, labels)) = _runner(4)
    with pytest.raises(AutopartError) as err:
        runner.step(ids[:, :24], labels[:, :24])  # 24 tokens: fewer than 8 per chunk
    assert "rank 0" in err.value.message and "cannot be cut into 4 chunks" in err.value.message
    assert "at most 3 chunks" in err.value.hint
    assert str(err.value).count("hint:") == 1  # (the hint was printed twice)
    runner.step(ids[:, :40], labels[:, :40])  # a shorter sequence than captured is fine


def test_too_many_chunks_for_the_example_are_refused_at_compile_time() -> None:
    model, batch = nanogpt.make()  # 32 tokens
    with pytest.raises(AutopartError) as err:
        parallelize(model, Mesh(pp=2), example_inputs=batch, schedule="seq1f1b", seq_chunks=5)
    assert "32 tokens cannot be cut into 5 chunks" in err.value.message
    assert "at most 4 chunks" in err.value.hint


@pytest.mark.slow  # timed steps and a refit
def test_measured_split_refits_the_boundaries_and_stays_exact() -> None:
    """seq_split="measured": the first steps time each chunk's forward and refit the cost
    coefficients the boundaries balance; any boundaries compute the same loss and gradients."""
    runner, (model, batch) = _runner(4, "measured")
    flops = runner.chunk_cost
    want_loss, want = run_model(model, batch)
    count = (batch[1] != -100).sum()
    for _ in range(4):
        for p in runner.parameters():
            p.grad = None
        loss = runner.step(*batch)
        assert rel_err(loss, want_loss / count) <= 1e-12
        for fqn, p in runner.named_parameters():
            assert rel_err(p.grad, want[fqn] / count) <= 1e-12, fqn
    assert runner.chunk_cost != flops  # fitted to this machine's times
    lengths = [e - a for a, e in runner._chunk_bounds(batch[0].shape[1])]
    assert sum(lengths) == 256 and len(lengths) == 4 and all(n % 8 == 0 for n in lengths)
