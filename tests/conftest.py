"""Shared fixtures: the examples on ``sys.path`` and one capture per model for the session.

Capturing costs about a second per model, so every test that only reads a capture shares
these. Tests that mutate a graph (a pass) work on a copy (``autopart.graph.copy_graph``).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import hf_gpt2  # noqa: E402
import nanogpt  # noqa: E402

from autopart.frontend.capture import Captured, capture, model_logits  # noqa: E402
from autopart.meta import META_INPUT  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Case:
    """A float64 model, its example batch and its capture (read-only: share, don't mutate)."""

    model: nn.Module
    batch: Batch
    captured: Captured


def _case(factory) -> Case:
    model, batch = factory()
    model = model.double()
    return Case(model, batch, capture(model, batch))


@pytest.fixture(scope="session")
def gpt_sdpa() -> Case:
    return _case(nanogpt.make)


@pytest.fixture(scope="session")
def gpt_manual() -> Case:
    return _case(nanogpt.make_manual)


@pytest.fixture(scope="session")
def hf_gpt() -> Case:
    return _case(hf_gpt2.make)


@pytest.fixture(params=["gpt_sdpa", "gpt_manual", "hf_gpt"])
def case(request) -> Case:
    """Each of the three captured models in turn."""
    return request.getfixturevalue(request.param)


def feed(captured: Captured, batch: Batch, params: dict[str, torch.Tensor] | None = None) -> list:
    """The graph's positional inputs, in placeholder order, from each placeholder's InputRef."""
    params = captured.params if params is None else params
    data = {"input_ids": batch[0], "labels": batch[1]}
    args = []
    for node in captured.placeholders():
        ref = node.meta[META_INPUT]
        if ref.kind == "param":
            args.append(params[ref.name])
        elif ref.kind in ("buffer", "constant"):
            args.append(captured.buffers[ref.name])
        else:
            args.append(data[ref.name])
    return args


def run_graph(captured: Captured, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss sum and gradients (by canonical FQN) of the captured functional graph."""
    params = {f: t.detach().clone().requires_grad_(True) for f, t in captured.params.items()}
    (loss,) = captured.graph(*feed(captured, batch, params))
    loss.backward()
    return loss.detach(), {f: p.grad for f, p in params.items()}


def run_model(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's own summed next-token CE and gradients (on a copy: the fixture stays clean)."""
    model = copy.deepcopy(model)
    logits = model_logits(model, batch[0], batch[1])
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        batch[1].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    loss.backward()
    return loss.detach(), {f: p.grad for f, p in model.named_parameters()}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    return diff / scale if scale > 0 else diff
