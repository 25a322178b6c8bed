"""``planning/memory.py``: the bytes a unit holds for backward, read off its graph on fake
tensors, equal what autograd saves when the same graph runs on real tensors (one process, no
ranks), with and without recomputation; the fake tensors dispatch as the CPU does."""

from __future__ import annotations

import pytest
import torch
from parity_cases import MANUAL, NANO

from autopart.frontend.capture import capture
from autopart.frontend.spec import build
from autopart.layout import Mesh, Plan
from autopart.lowering.compile import compile_program
from autopart.planning.memory import unit_bytes
from autopart.runtime.recompute import checkpointed
from autopart.runtime.runner import SavedBytes


def _measured(program, x, y) -> int:
    """Bytes autograd saves for one forward of the single stage, on real tensors (the runtime's
    count: ``SavedBytes`` around the checkpointed graph)."""
    rp = program.ranks[0]
    (st,) = rp.stages
    params = {f: torch.nn.Parameter(t.clone()) for f, t in program.params.items() if f in rp.shards}
    saved = SavedBytes()
    saved.reset([*params.values(), *program.buffers.values()])
    data = {"input_ids": x, "labels": y}
    args = [
        params[r.name]
        if r.kind == "param"
        else data[r.name]
        if r.kind == "data"
        else torch.tensor(0)
        if r.kind in ("rng", "rank")
        else program.buffers[r.name]
        for r in st.inputs
    ]
    with saved.watch((0, 0, 0)):
        checkpointed(st.graph)(*args)
    return saved.peak


@pytest.mark.parametrize(
    "spec,recompute",
    [(NANO, "none"), (NANO, "full"), (MANUAL, "selective")],
    ids=["sdpa-none", "sdpa-full", "manual-selective"],
)
def test_unit_bytes_equal_what_autograd_saves(spec: str, recompute: str) -> None:
    model, (x, y) = build(spec)
    program = compile_program(capture(model, (x, y)), Plan(Mesh(), recompute=recompute))
    ((held, transient),) = unit_bytes(program, *x.shape).values()
    assert held == _measured(program, x, y) > 0
    assert (transient > 0) == (recompute != "none")


def test_fake_tensors_dispatch_as_the_cpu() -> None:
    """On the CPU, SDPA is one fused kernel that saves nothing s²-sized; on ``meta`` it would
    take the math path and save the scores: the prediction must follow the CPU."""
    model, (x, y) = build(NANO)
    program = compile_program(capture(model, (x, y)), Plan(Mesh()))
    ((cpu, _),) = unit_bytes(program, *x.shape).values()
    ((meta, _),) = unit_bytes(program, *x.shape, device="meta").values()
    assert cpu == _measured(program, x, y)
    assert meta > cpu
