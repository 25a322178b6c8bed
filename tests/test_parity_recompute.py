"""Float64 parity of activation recomputation (issue 18): none, selective and full on nanoGPT,
HF GPT-2 and HF Llama under tp2 x pp2 Seq1F1B, their saved bytes, and exactness under dropout.
One batch (``verify_many``, forked ranks), as the other parity matrices."""

from __future__ import annotations

import pytest
import torch
from parity_cases import RECOMPUTE_CASES, assert_passes, batch, cross_section, selects_slow

from autopart import AutopartError
from autopart.parity.verify import Check, Report

pytestmark = pytest.mark.multirank


# the default suite's cross-section (every mode, both attention forms, on nanoGPT); the whole
# matrix (HF GPT-2 and Llama too) runs with -m slow: suite time
DEFAULT = [c for c in RECOMPUTE_CASES if c.startswith("nanogpt")]
SLOW = pytest.mark.slow


@pytest.fixture(scope="module")
def recompute_reports(request: pytest.FixtureRequest) -> dict[str, Report | AutopartError]:
    names = list(RECOMPUTE_CASES) if selects_slow(request.config) else DEFAULT
    return batch(
        {name: Check(RECOMPUTE_CASES[name][0], **RECOMPUTE_CASES[name][1]) for name in names}
    )


@pytest.mark.parametrize("case", cross_section(list(RECOMPUTE_CASES), DEFAULT))
def test_recompute_float64_parity(case: str, recompute_reports: dict) -> None:
    assert_passes(recompute_reports[case])


@pytest.mark.parametrize(
    "model", ["nanogpt", pytest.param("hf_gpt2", marks=SLOW), pytest.param("hf_llama", marks=SLOW)]
)
def test_recompute_saves_less(model: str, recompute_reports: dict) -> None:
    """Full recomputation keeps each block's input only: every rank saves under a third of what
    it saves without. Selective drops nothing s²-sized where attention is one fused kernel
    (Seq1F1B's SDPA saves q, k, v, output and log-sum-exp), but it keeps the region's inputs
    instead of the kernel's saves: never more than none (measured: 8-21 % less)."""
    none, sel, full = (recompute_reports[f"{model}-{rc}"] for rc in ("none", "selective", "full"))
    print(
        model, "saved bytes per rank: none", none.saved, "selective", sel.saved, "full", full.saved
    )
    assert all(n > 0 for n in none.saved)
    assert all(f < n / 3 for f, n in zip(full.saved, none.saved, strict=True))
    assert all(s < n for s, n in zip(sel.saved, none.saved, strict=True))


def test_selective_recompute_drops_materialized_scores(recompute_reports: dict) -> None:
    """With the manual masked-softmax attention (scores, softmax and dropout materialized, as
    Megatron ran in 2021) selective recomputation keeps under half of what none keeps."""
    none, sel = (recompute_reports[f"nanogpt_manual-1f1b-{rc}"] for rc in ("none", "selective"))
    print("nanogpt manual attention saved bytes per rank: none", none.saved, "selective", sel.saved)
    assert all(s < n / 2 for s, n in zip(sel.saved, none.saved, strict=True))


@pytest.mark.parametrize(
    "attention,plan",
    [
        ("manual", {"tp": 2, "pp": 2, "microbatches": 2, "sequence_parallel": True}),
    ],
)
@SLOW  # suite time
def test_recompute_is_exact_under_dropout(attention: str, plan: dict, tmp_path) -> None:
    """With dropout (p = 0.2) the recomputed forward draws the masks the first forward drew:
    loss and every gradient of selective and full recomputation equal those without."""
    import nanogpt

    from autopart import parallelize
    from autopart.frontend.capture import capture
    from autopart.layout import Mesh
    from autopart.parity.checks import fork_ranks
    from autopart.parity.verify import gather

    model, batch_ = nanogpt.make(attention=attention, dropout=0.2)
    captured = capture(model.double(), batch_)
    mesh = Mesh(tp=plan.pop("tp", 1), pp=plan.pop("pp"))
    runs = {}
    for rc in ("none", "selective", "full"):
        program = parallelize(captured, mesh, recompute=rc, **plan)
        fork_ranks(program, batch_, tmp_path / rc, timeout_s=120)
        dumps = [torch.load(tmp_path / rc / f"rank{r:05d}.pt") for r in range(mesh.size)]
        runs[rc] = (float(dumps[0]["loss"]), gather(dumps))
    loss, grads = runs["none"]
    for rc in ("selective", "full"):
        assert runs[rc][0] == pytest.approx(loss, rel=1e-12)
        for fqn, copies in grads.items():
            for got, ref in zip(runs[rc][1][fqn], copies, strict=True):
                assert torch.allclose(got, ref, rtol=1e-10, atol=1e-14), (rc, fqn)


@pytest.mark.parametrize(
    "case",
    [
        "nanogpt-none",
        pytest.param("hf_gpt2-selective", marks=SLOW),
        pytest.param("hf_llama-full", marks=SLOW),
        pytest.param("nanogpt_manual-1f1b-selective", marks=SLOW),
    ],
)
def test_simulator_predicts_saved_bytes(case: str, recompute_reports: dict) -> None:
    """The simulator's activation-memory prediction for a captured model (each unit's bytes read
    off the compiled graphs on fake tensors, added up over each rank's schedule) is within 10 %
    of the peak bytes every rank measured in the parity run (float64, the same plan). Each mode
    and model once here (suite time); benchmarks/recompute.py prints all twelve, float32."""
    from autopart.frontend.capture import capture
    from autopart.frontend.spec import build
    from autopart.layout import Plan
    from autopart.planning.memory import graph_memory
    from autopart.planning.simulate import shape_from_captured, simulate

    spec, kw = RECOMPUTE_CASES[case]
    model, (x, y) = build(spec)
    captured = capture(model.to(torch.float64), (x, y))
    kw = dict(kw)
    m = kw.pop("microbatches")
    plan = Plan.from_batch(x.shape[0], x.shape[0] // m, dp=1, **kw)
    sim = simulate(
        shape_from_captured(captured), "dgx-a100-80gb", plan, memory=graph_memory(captured, plan)
    )
    predicted = sim.summary.memory.per_rank_saved_activations  # GiB, per pipeline rank
    measured = recompute_reports[case].saved
    print(case, "predicted KiB", [round(p * 2**20) for p in predicted], "measured", measured)
    for r, got in enumerate(measured):
        want = predicted[plan.mesh.coords(r).pp] * 2**30
        assert abs(want - got) <= 0.10 * got, (r, want, got)
