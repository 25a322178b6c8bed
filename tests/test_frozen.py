"""A model with a frozen parameter (``requires_grad=False``: ERNIE 4.5's routing-score bias,
a frozen embedding) trains under data parallelism: no rank arms a gradient hook on it (that
crashed every rank), it stays out of the all-reduced buckets (a zero gradient there would let
weight decay move it), and every other gradient matches one device."""

from __future__ import annotations

from conftest import nanogpt

from autopart import AutopartError
from autopart.parity.verify import Check, verify_many


def _frozen():
    model, batch = nanogpt.make()
    frozen = [p for n, p in model.named_parameters() if n.endswith("ln_f.weight")]
    assert len(frozen) == 1
    frozen[0].requires_grad_(False)
    return model, batch


def test_a_frozen_parameter_trains_under_dp() -> None:
    (report,) = verify_many([Check(_frozen, dp=2)], via="fork", timeout_s=60).values()
    assert not isinstance(report, AutopartError), report
    assert report.ok and report.tolerance == 1e-9, str(report)
