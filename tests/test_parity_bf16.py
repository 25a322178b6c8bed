"""Mixed precision (issue 18, part 1): bf16 compute with float32 master weights, gradients and
loss, against one device under the same policy, for dp=2, tp=2 with sequence parallelism, pp=2
1F1B, pp=2 Seq1F1B k=2 and tp2 x pp2. The tolerance is per model: twice the one-device bf16
run's own error against float32 (``verify.own_error``; docs/precision.md says why)."""

from __future__ import annotations

import pytest
import torch
from parity_cases import GPT2, LLAMA, LONG, NANO, cross_section, selects_slow

from autopart import AutopartError, Mesh, parallelize
from autopart.frontend.capture import capture, capture_mixed
from autopart.frontend.spec import build
from autopart.parity.verify import BF16_MARGIN, Check, Report, verify_many

pytestmark = pytest.mark.multirank

CASES = {
    "nanogpt-dp2": Check(NANO, dp=2, microbatches=2),
    "gpt2-tp2-sp": Check(GPT2, tp=2, sequence_parallel=True),
    "llama-pp2-1f1b": Check(LLAMA, pp=2, microbatches=2),
    "gpt2-pp2-seq1f1b-k2": Check(
        LONG["hf_gpt2"], pp=2, schedule="seq1f1b", seq_chunks=2, microbatches=2
    ),
    "llama-tp2xpp2": Check(LONG["hf_llama"], tp=2, pp=2, microbatches=2),
}


DEFAULT = ["gpt2-tp2-sp", "llama-tp2xpp2"]  # all with -m slow


@pytest.fixture(scope="module")
def reports(request: pytest.FixtureRequest) -> dict[str, Report | AutopartError]:
    names = list(CASES) if selects_slow(request.config) else DEFAULT
    return verify_many({n: CASES[n] for n in names}, dtype="bfloat16", timeout_s=120, via="fork")


@pytest.mark.parametrize("case", cross_section(list(CASES), DEFAULT))
def test_bf16_parity(case: str, reports: dict) -> None:
    r = reports[case]
    if isinstance(r, AutopartError):
        raise r
    print(
        case, f"loss {r.loss_error:.1e} grad {r.grad_error:.1e} ({r.worst}) tol {r.tolerance:.1e}"
    )
    assert r.ok, str(r)
    # the tolerance is the precision's own rounding, not a blanket: bf16 moves these gradients
    # by 1e-2..2e-1 against float32, so twice that stays well under anything O(1) wrong
    assert 1e-3 < r.tolerance / BF16_MARGIN < 0.25


def test_bf16_graph_masters_and_loss() -> None:
    """The captured graph computes in bf16 with the loss in float32; the parameters the program
    keeps (and checkpoints save) are the model's float32 masters."""
    model, batch = build(NANO)
    captured = capture_mixed(model, batch)
    assert all(p.dtype == torch.float32 for p in captured.params.values())
    assert (
        dict(model.named_parameters())["transformer.wte.weight"]
        is captured.params["transformer.wte.weight"]
    )
    ce = next(
        n
        for n in captured.graph.graph.nodes
        if n.target == torch.ops.aten.cross_entropy_loss.default
    )
    assert ce.args[0].meta["val"].dtype == torch.float32
    linears = [n for n in captured.graph.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert linears and all(n.meta["val"].dtype == torch.bfloat16 for n in linears)
    program = parallelize(model, Mesh(pp=2), example_inputs=batch, precision="bf16")
    assert program.plan.precision == "bf16" and "bf16" in program.plan.describe()
    assert program.params["transformer.wte.weight"].dtype == torch.float32
    with pytest.raises(AutopartError, match="captured in torch.float32"):
        parallelize(capture(model, batch), Mesh(), precision="bf16")
    with pytest.raises(AutopartError, match="unknown precision 'fp8'"):
        parallelize(model, Mesh(), example_inputs=batch, precision="fp8")
