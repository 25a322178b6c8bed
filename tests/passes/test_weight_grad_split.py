"""weight_grad_split: under a zero-bubble schedule no parameter GEMM is left in aten form (each is
``autopart::weight_gemm``, as many as there were); under any other schedule nothing changes."""

from __future__ import annotations

import pytest
import torch

from autopart.layout import Mesh, Plan
from autopart.lowering import compile_program
from autopart.meta import META_INPUT

aten = torch.ops.aten
GEMMS = (aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default)


def _param(n) -> bool:
    ref = n.meta.get(META_INPUT) if hasattr(n, "meta") else None
    return ref is not None and ref.kind == "param"


def _gemms(program) -> tuple[int, int]:
    """(aten GEMMs on a parameter weight, weight_gemm nodes) over a program's stages."""
    aten_on_params = deferred_nodes = 0
    for rank in program.ranks:
        for st in rank.stages:
            for n in st.graph.graph.nodes:
                if n.target == torch.ops.autopart.weight_gemm.default:
                    deferred_nodes += 1
                elif n.target in GEMMS and any(_param(a) for a in n.args[:3]):
                    aten_on_params += 1
    return aten_on_params, deferred_nodes


@pytest.mark.parametrize("model", ["gpt_sdpa", "hf_gpt"])
def test_split_schedules_defer_every_parameter_gemm(model, request) -> None:
    captured = request.getfixturevalue(model).captured
    plain = compile_program(captured, Plan(Mesh(pp=2), schedule="1f1b", microbatches=2))
    split = compile_program(captured, Plan(Mesh(pp=2), schedule="zb-h1", microbatches=2))
    before, none = _gemms(plain)
    assert before > 0 and none == 0
    assert _gemms(split) == (0, before)
    assert any(a.kind == "W" for r in split.ranks for a in r.actions)
