"""autopart in an ordinary training loop (issue 36): what a DDP user's habits need to be
right. Real gloo ranks (``launch_forked``); nothing is mocked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import autopart
from autopart.parity.verify import launch_forked

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))


@pytest.mark.multirank
@pytest.mark.parametrize("mesh", ["dp2pp2", "tp2pp2"])
def test_a_loop_with_clipping_and_different_seeds_equals_one_process(mesh: str) -> None:
    """Ranks built from different seeds (parallelize starts them all from rank 0's model),
    AdamW with decay groups, warmup, clipping that bites every step (``clip_grad_norm_``, the
    same global norm on every rank), unequal -100 padding: every step's loss and grad norm and
    every final weight equal the single-process loop in float64; ``full_state_dict()`` loads
    strictly into a fresh model, and ``copy_to(model)`` leaves the user's module trained (it
    used to keep untrained copies, so ``save_pretrained`` saved the initial weights).
    ``eval()`` + ``evaluate()``: forward only, every dropout off (a nanoGPT with p = 0.3 gives
    the model's own eval loss), no gradient touched."""
    out = launch_forked(4, [str(ROOT / "tests" / "loop_script.py"), mesh], timeout_s=300)
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert len(rows) == 4, out
    for r in rows:
        assert r["clipped"] == 8, r  # the clip bit at every step
        assert r["loss_err"] <= 1e-9 and r["norm_err"] <= 1e-9, r
        assert r["weight_err"] <= 1e-9, r
        assert r["keys_match"] and r["state_dict_err"] <= 1e-9 and r["copy_to_err"] <= 1e-9, r
        assert r["eval_err"] <= 1e-9 and r["grads_untouched"], r
        assert r["dropout_eval_err"] <= 1e-9 and r["dropout_train_differs"], r


def test_use_cache_true_no_longer_leaves_attention_replicated() -> None:
    """HF's default use_cache=True used to leave every attention replicated under tp (its
    cache outputs keep K and V whole); capture now asks the model for no cache."""
    import hf_llama

    model, batch = hf_llama.make()
    model.config.use_cache = True
    program = autopart.parallelize(model, autopart.Mesh(tp=2), batch)
    shards = program.rank(0).shards
    attn = [f for f in shards if "self_attn" in f and f.endswith("proj.weight")]
    assert len(attn) == 8 and all(shards[f].dim is not None for f in attn), {
        f: shards[f].dim for f in attn
    }
    assert torch.is_tensor(batch[0])


def test_the_documented_import_path_works() -> None:
    """``from autopart import checkpoint`` (README, docs/checkpoint.md) used to raise."""
    from autopart import checkpoint

    assert callable(checkpoint.save) and callable(checkpoint.load)
