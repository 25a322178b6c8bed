"""Model specs: ``file.py:make`` or ``module:make`` → a factory, and build() checking its result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import REPO, nanogpt
from torch import nn

from autopart.errors import AutopartError
from autopart.frontend.spec import build, load_factory


def test_load_factory_from_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    make = load_factory("examples/nanogpt.py:make")
    assert callable(make) and make.__name__ == "make"
    model, (ids, labels) = make()
    assert type(model).__name__ == "GPT" and ids.shape == labels.shape == (8, 32)


def test_load_factory_from_an_absolute_file() -> None:
    make = load_factory(f"{REPO / 'examples' / 'nanogpt.py'}:make_manual")
    model, _ = make()
    assert model.config.attention == "manual"


def test_load_factory_from_a_module() -> None:
    assert load_factory("nanogpt:make") is nanogpt.make  # examples/ is on sys.path (conftest)
    assert load_factory("os.path:join")("a", "b") == "a/b"


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("nocolon", "has no ':function' part"),
        ("examples/nanogpt.py:", "has no ':function' part"),
        (":make", "has no ':function' part"),
        ("examples/missing.py:make", "does not exist"),
        ("examples/:make", "is not a Python file"),  # a folder: a bare AttributeError before
        ("examples/nanogpt.py:nope", "has no function 'nope'"),
        ("examples/nanogpt.py:GPTConfig.n_layer", "has no function"),
        ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
        ("nanogpt:missing", "has no function 'missing'"),
    ],
)
def test_bad_specs(spec: str, needle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(AutopartError) as err:
        load_factory(spec)
    assert needle in err.value.message


def test_build_checks_and_returns_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    model, (ids, labels) = build("examples/nanogpt.py:make")
    assert isinstance(model, nn.Module)
    want_ids, want_labels = nanogpt.make()[1]
    assert torch.equal(ids, want_ids) and torch.equal(labels, want_labels)
    model2, batch2 = build(nanogpt.make)  # a factory itself works too
    assert isinstance(model2, nn.Module) and torch.equal(batch2[0], want_ids)


def _model() -> nn.Module:
    return nn.Linear(2, 2)


def _ids() -> torch.Tensor:
    return torch.zeros(2, 4, dtype=torch.long)


@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        (_model, "must return (model, (input_ids, labels)), got Linear"),
        (lambda: [_model(), (_ids(), _ids())], "got list"),
        (lambda: (_model(), (_ids(), _ids()), None), "got tuple"),
        (lambda: ("model", (_ids(), _ids())), "got tuple"),
        (lambda: ((_ids(), _ids()), _model()), "got tuple"),
        (lambda: (_model(), (_ids(),)), "example_inputs must be (input_ids, labels)"),
        (lambda: (_model(), (_ids().float(), _ids())), "input_ids must be an int64"),
        (lambda: (_model(), (_ids()[:, :1], _ids()[:, :1])), "too small"),
    ],
    ids=[
        "model-only",
        "list",
        "triple",
        "not-a-module",
        "swapped",
        "one-tensor",
        "float",
        "seq-1",
    ],
)
def test_build_rejects_wrong_shapes(factory, needle: str) -> None:
    with pytest.raises(AutopartError) as err:
        build(factory)
    assert needle in err.value.message


def test_build_rejects_a_bad_file_factory(tmp_path: Path) -> None:
    f = tmp_path / "bad_factory.py"
    f.write_text("def make():\n    return 42\n")
    with pytest.raises(AutopartError) as err:
        build(f"{f}:make")
    assert f"{f}:make must return (model, (input_ids, labels)), got int" in err.value.message
