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


def test_a_convolution_carry_is_fed_in_the_dry_run(monkeypatch) -> None:
    """Under Seq1F1B the dry run feeds each causal convolution's carry like a K/V prefix (as
    long as the chunks before the last; the graph keeps its last window): the toy of
    test_parity_conv compiles (its parity tests). Negative control: with the prefix length put
    in dim −2, as the dry run did when every prefix was a K/V one, the carry ([b, channels, P])
    no longer fits and the convolution's concatenation is named."""
    from test_parity_conv import make_toy

    model, data = make_toy()
    captured = capture(model.double(), data)
    plan = {"schedule": "seq1f1b", "seq_chunks": 2, "microbatches": 2}

    def kv_only(shape: list, rows: int, length: int) -> list:
        out = [rows if d == "b" else d for d in shape]
        out[-2] = length
        return out

    monkeypatch.setattr(sys.modules["autopart.lowering.dry_run"], "_prefix_shape", kv_only)
    with pytest.raises(AutopartError) as err:
        parallelize(captured, Mesh(pp=2), **plan)
    msg = err.value.message
    assert "(aten::cat, module blocks.0.mixer.conv)" in msg and "fails on fake inputs" in msg, msg
