"""``autopart train CONFIG.toml`` (autopart/cli/train.py, autopart/runtime/train.py): the config
checked before any rank starts, and a run that trains, validates, checkpoints, is killed and
resumes bitwise. Real torchrun ranks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autopart import AutopartError
from autopart.runtime import checkpoint
from autopart.runtime.train_config import TrainConfig, from_dict, load, lr_factor

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
out = "{out}"
[parallel]
dp = 1
tp = 1
pp = 2
microbatches = 2
[data]
seq_len = 32
batch_size = 4
[optim]
warmup_steps = 2
[train]
steps = 6
[eval]
every = 3
[checkpoint]
every = 1
keep = 0
"""


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"optim": {"lr": "fast"}}, "[optim] lr = 'fast' is a str, not a float"),
        ({"optim": {"learning_rate": 1e-3}}, "unknown key [optim] learning_rate"),
        ({"optimizer": {"lr": 1e-3}}, "unknown section [optimizer]"),
        ({"train": {"steps": 0}}, "[train] steps = 0 must be positive"),
        ({"parallel": {"tp": True}}, "[parallel] tp = True is a bool, not a int"),
        ({"data": {"text": "a", "tokens": "b"}}, "not ['text', 'tokens']"),
        ({"optim": {"lr": 1e-3, "min_lr": 1e-2}}, "min_lr <= lr"),
        ({"data": {"val_fraction": 0.0}}, "leaves nothing to validate on"),
        ({"steps": 5}, "unknown key steps"),
        ({"data": {"text": "a.txt", "dataset": "text"}}, "not ['text', 'dataset']"),
        ({"data": {"tokens": "a.pt", "tokenizer": "gpt2"}}, "tokenizer applies to text"),
        ({"data": {"dataset_files": "a.txt"}}, "need a dataset"),
        ({"parallel": {"library_ops": "mylib"}}, "is not a list of strings"),
        ({"parallel": {"library_ops": ["aten"]}}, "[parallel] library_ops: 'aten' is not a"),
        # TOML's nan and inf passed every range check (a nan max_grad_norm made every weight nan)
        ({"optim": {"max_grad_norm": float("nan")}}, "[optim] max_grad_norm = nan must be a fin"),
        ({"train": {"timeout": float("inf")}}, "[train] timeout = inf must be a finite number"),
        ({"optim": {"beta2": 1.0}}, "need betas in [0, 1) and eps > 0"),
        ({"optim": {"eps": 0.0}}, "need betas in [0, 1) and eps > 0"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(doc: dict, message: str) -> None:
    with pytest.raises(AutopartError) as err:
        from_dict(doc)
    assert message in str(err.value), str(err.value)


def test_a_dataset_and_a_tokenizer_give_the_token_ids(tmp_path: Path, monkeypatch) -> None:
    """[data] dataset through the `datasets` library (its local "text" builder: nothing is
    downloaded), as bytes and through a tokenizer saved in a folder; a missing column and a
    tokenizer that does not load are named."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from autopart.cli.train import _read_data

    docs = tmp_path / "docs.txt"
    docs.write_text("the cat sat\nthe dog ran\n")
    cfg = from_dict({"data": {"dataset": "text", "dataset_files": str(docs)}})
    ids = _read_data(cfg)
    assert bytes(ids.to(torch.uint8).tolist()) == b"the cat sat\nthe dog ran"
    vocab = {"[UNK]": 0, "<eos>": 1, "the": 2, "cat": 3, "sat": 4, "dog": 5, "ran": 6}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="[UNK]")
    tok.save_pretrained(tmp_path / "tok")
    cfg = from_dict(
        {
            "data": {
                "dataset": "text",
                "dataset_files": str(docs),
                "tokenizer": str(tmp_path / "tok"),
            }
        }
    )
    assert _read_data(cfg).tolist() == [2, 3, 4, 1, 2, 5, 6, 1]
    cfg = from_dict({"data": {"text": str(docs), "tokenizer": str(tmp_path / "tok")}})
    assert _read_data(cfg).tolist() == [2, 3, 4, 2, 5, 6, 1]
    with pytest.raises(AutopartError, match="field = 'body' is not a column"):
        _read_data(
            from_dict({"data": {"dataset": "text", "dataset_files": str(docs), "field": "body"}})
        )
    with pytest.raises(AutopartError, match="could not be loaded"):
        _read_data(from_dict({"data": {"text": str(docs), "tokenizer": str(tmp_path / "none")}}))


def test_overrides_and_the_schedule(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[optim]\nlr = 1e-3\nmin_lr = 1e-4\nwarmup_steps = 4\n[train]\nsteps = 14\n")
    cfg = load(f, ["optim.lr=2e-3", "data.text=corpus.txt"])
    assert cfg.optim_lr == 2e-3 and cfg.data_text == "corpus.txt"
    assert isinstance(cfg, TrainConfig)
    assert [lr_factor(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # warmup
    assert lr_factor(4, cfg) == 1.0 and abs(lr_factor(13, cfg) - 0.05) < 1e-12  # the last
    assert lr_factor(12, cfg) > 0.05  # of the 14 steps (index 13) trains at min_lr, not after
    trusting = load(f, ['parallel.library_ops=["mylib"]'])
    assert trusting.parallel_library_ops == ("mylib",) and cfg.parallel_library_ops == ()
    assert TrainConfig.from_json(json.loads(json.dumps(trusting.to_json()))) == trusting
    with pytest.raises(AutopartError) as err:  # named with the --set it came from
        load(f, ["train.steps=0"])
    assert f"{f} (--set train.steps=0): [train] steps = 0 must be positive" in err.value.message


def _train(config: Path, *more: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "autopart", "train", str(config), *more],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return checkpoint.export_state_dict(checkpoint.folder(out / "checkpoints", step))


@pytest.mark.slow
@pytest.mark.multirank
def test_train_checkpoints_is_killed_and_resumes_bitwise(tmp_path: Path) -> None:
    """A whole run (6 steps on the demo text, pp=2, eval every 3, a checkpoint every step) and
    a run killed with SIGTERM after its third checkpoint then started again: the second resumes
    from the newest intact checkpoint and ends with the first one's weights, bit for bit; both
    write their metrics, each step once."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    for out in (whole, killed):
        out.mkdir()
        (out / "train.toml").write_text(CONFIG.format(out=out / "run"))
    p = _train(whole / "train.toml")
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log
    p = _train(killed / "train.toml")
    marker = checkpoint.folder(killed / "run" / "checkpoints", 3) / checkpoint.INFO
    deadline = time.monotonic() + 300
    while not marker.exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    first = p.communicate(timeout=60)[0]
    assert marker.exists(), first
    p = _train(killed / "train.toml")
    second = p.communicate(timeout=300)[0]
    assert p.returncode == 0, second
    assert "resumed from step" in second, second
    want, got = _weights(whole / "run", 6), _weights(killed / "run", 6)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    rows = [json.loads(x) for x in (whole / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    resumed = [json.loads(x) for x in (killed / "run" / "metrics.jsonl").read_text().splitlines()]
    # each step logged once: the resumed run dropped the rows logged after its checkpoint
    # (they were appended again, twice, and a plot drew them twice)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6], resumed
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]


@pytest.mark.multirank
def test_a_bad_config_is_refused_once_before_any_rank(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(CONFIG.format(out=tmp_path / "run") + "\n[log]\njsnl = 'm.jsonl'\n")
    r = subprocess.run(
        [sys.executable, "-m", "autopart", "train", str(f)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.count("unknown key [log] jsnl") == 1, r.stderr
    assert "launching" not in r.stdout


def test_a_resumed_run_drops_the_metrics_it_logs_again(tmp_path: Path) -> None:
    """Rows of steps after the checkpoint a run resumes from are trained, and logged, again:
    they are dropped first (they were appended twice). Other lines stay as they were."""
    from autopart.runtime.train import _drop_rows_after

    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)]
    path.write_text("".join(rows) + "not json\n")
    _drop_rows_after(path, 3)
    assert path.read_text() == "".join(rows[:3]) + "not json\n"
    _drop_rows_after(tmp_path / "none.jsonl", 3)  # a first run: nothing to drop
    assert not (tmp_path / "none.jsonl").exists()
