"""compile_program's dry run (lowering/dry_run.py): every stage's forward and backward once on
fake tensors of its real input shapes, so what would stop every rank at its first step is
refused at compile time, naming the stage, the node and its module."""

from __future__ import annotations

import sys

import pytest
import torch
from test_capture import _SliceAssign

from autopart import Mesh, parallelize
from autopart.errors import AutopartError
from autopart.frontend.capture import Captured, capture
from autopart.graph import copy_graph

aten = torch.ops.aten


def _captured() -> tuple[Captured, torch.Tensor]:
    ids = torch.randint(0, 50, (4, 16))
    return capture(_SliceAssign().double(), (ids, ids)), ids


def _with_graph(captured: Captured, gm: torch.fx.GraphModule) -> Captured:
    return Captured(
        gm,
        captured.params,
        captured.buffers,
        captured.tied,
        captured.example_shape,
        captured.dtype,
        captured.vocab_size,
    )


def test_an_op_without_a_derivative_is_refused_before_launch() -> None:
    """The graph DeepSeek-V3 had before capture gave slice assignments a derivative: an
    ``aten.copy`` in the forward. Every plan used to crash in every rank's backward
    ("derivative for aten::copy is not implemented"); now compile_program names the node."""
    captured, _ = _captured()
    gm = copy_graph(captured.graph)
    gm.meta.update(captured.graph.meta)
    clone = next(n for n in gm.graph.nodes if n.target == aten.clone.default)
    with gm.graph.inserting_after(clone):
        copy = gm.graph.call_function(aten.copy.default, (clone, clone))
    clone.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)
    copy.meta.update(clone.meta)
    gm.recompile()
    for mesh in (Mesh(dp=2), Mesh(tp=2)):
        with pytest.raises(AutopartError) as err:
            parallelize(_with_graph(captured, gm), mesh)
        msg = err.value.message
        assert "node copy_default (aten::copy, module <root>)" in msg, msg
        assert "has no derivative" in msg, msg
        assert msg.startswith("stage 0: node"), msg
    parallelize(captured, Mesh(dp=2))  # the control: capture's own graph


def test_a_shape_that_fits_no_real_input_is_refused_naming_the_node(monkeypatch) -> None:
    """A stage graph whose view fits the symbolic shapes a pass saw but not the stage's real
    inputs fails here, not in the ranks."""
    captured, _ = _captured()
    compile_mod = sys.modules["autopart.lowering.compile"]
    split = compile_mod.split_stages

    def broken(gm):
        stages, inputs = split(gm)
        view = next(n for n in stages[-1].graph.nodes if n.target == aten.reshape.default)
        view.update_arg(1, [7, -1])  # 4·16·50 logits do not split into 7 rows
        stages[-1].recompile()
        return stages, inputs

    monkeypatch.setattr(compile_mod, "split_stages", broken)
    with pytest.raises(AutopartError) as err:
        parallelize(captured, Mesh(dp=2))
    msg = err.value.message
    assert msg.startswith("stage 0: node ") and "aten::reshape" in msg, msg
    assert "fails on fake inputs of the stage's shapes" in msg, msg
