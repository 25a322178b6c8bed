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
@pytest.mark.parametrize(
    "mesh",
    ["dp2pp2", pytest.param("tp2pp2", marks=pytest.mark.slow)],  # tp2pp2: -m slow
)
def test_a_loop_with_clipping_and_different_seeds_equals_one_process(mesh: str) -> None:
    """Ranks built from different seeds (parallelize starts them all from rank 0's model),
    a module the forward never uses (held by pipeline rank 0, its gradient None as on one
    device: under pp no rank held it, and under dp its zero gradient took AdamW's decay),
    AdamW with decay groups, warmup, clipping that bites every step (``clip_grad_norm_``, the
    same global norm on every rank), unequal -100 padding: every step's loss and grad norm and
    every final weight equal the single-process loop in float64; ``full_state_dict()`` loads
    strictly into a fresh model, and ``copy_to(model)`` leaves the user's module trained (it
    used to keep untrained copies, so ``save_pretrained`` saved the initial weights).
    ``eval()`` + ``evaluate()``: forward only, every dropout off (a nanoGPT with p = 0.3 gives
    the model's own eval loss), no gradient touched. The model is captured and compiled once,
    on rank 0; the other ranks load their rank's program from it (runtime/handover.py).
    The runner follows the module's mode (a module in eval mode at ``parallelize`` still gets
    its dropout back with ``model.train()``), and the habits wrong here are refused where they
    happen (runtime/guards.py): torch's ``clip_grad_norm_`` over the pp shards (and
    ``clip_grads_with_norm_`` handed a norm of the rank's gradients), an optimizer
    over the module's own parameters, a step under autocast or no_grad, torch's clipping over
    the module's parameters (no gradients there), reading the module's weights once the runner
    has moved its own (``model(ids)``, ``state_dict()``, ``deepcopy``) until ``copy_to``, and a
    parameter frozen after ``parallelize``; ``model.zero_grad()`` clears the runner's gradients
    (they used to add up). Value clipping and a reference loop on the module itself (after
    ``copy_to``) are not refused."""
    out = launch_forked(4, [str(ROOT / "tests" / "loop_script.py"), mesh], timeout_s=300)
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert len(rows) == 4, out
    for r in rows:
        assert r["clipped"] == 8, r  # the clip bit at every step
        assert r["loss_err"] <= 1e-9 and r["norm_err"] <= 1e-9, r
        assert r["weight_err"] <= 1e-9, r
        assert r["zero_grad"] and r["call_refused"], r
        assert r["keys_match"] and r["state_dict_err"] <= 1e-9 and r["copy_to_err"] <= 1e-9, r
        assert r["eval_err"] <= 1e-9 and r["grads_untouched"], r
        assert r["logits_err"] <= 1e-9 and r["logits_shape"] == [8, 32, 96], r
        assert r["dropout_eval_err"] <= 1e-9 and r["dropout_train_differs"], r
        assert r["modes_follow"], r
        assert all(r["habits"].values()), r
        assert r["load_state"], r
        assert r["captures"] == (1 if r["rank"] == 0 else 0), r  # compiled once, on rank 0
    print(mesh, "parallelize seconds per rank:", [round(r["parallelize_s"], 1) for r in rows])


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


@pytest.mark.multirank
def test_accumulation_over_steps_equals_one_big_batch() -> None:
    """Two steps (the first in ``no_sync()``, so dp reduces once), each given the token count
    of both: the gradients of one step on both batches, with unequal padding (each step's own
    mean used to weight them wrongly). ``num_tokens`` below this step's global label count (a
    replica's own count under ``local=True``), differing over the dp replicas, or not whole is
    refused on every rank; steps without it that add up gradients warn once."""
    out = launch_forked(2, [str(ROOT / "tests" / "accum_script.py")], timeout_s=120)
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert len(rows) == 2 and all(r["err"] <= 1e-9 and r["unreduced"] for r in rows), rows
    assert all(r["local_err"] <= 1e-9 for r in rows), rows  # each rank's own share
    assert all(all(r["tokens"].values()) for r in rows), [r["tokens"] for r in rows]


@pytest.mark.multirank
def test_pipeline_stages_keep_their_own_groups_and_frozen_weights(tmp_path: Path) -> None:
    """pp=2, tied embeddings frozen, one AdamW group per layer at its own rate (each stage's
    groups differ): the frozen weight keeps no gradient and does not move under weight decay;
    a checkpoint gives each stage its own rates back, and a dp=2 layout each layer's; a group
    merging layers saved at different rates is refused, on every rank when one rank holds it;
    each rank's own ``extra`` comes back under the same layout; ranks passing other optimizers
    or a NaN ``extra`` are refused alike; a tensor learning rate comes back
    (tests/stage_groups_script.py)."""
    out = launch_forked(
        2, [str(ROOT / "tests" / "stage_groups_script.py"), str(tmp_path / "ck")], timeout_s=180
    )
    rows = sorted(
        (json.loads(x) for x in out.splitlines() if x.startswith("{")), key=lambda r: r["rank"]
    )
    assert len(rows) == 2, out
    for r in rows:
        assert r["tied"] and all(r["frozen_grads_none"]) and r["frozen_moved"] == 0.0, r
        assert r["back"] == r["rates"], r  # its own stage's rates, not rank 0's
        assert r["dp_rates"] == [1e-3, 2e-3, 4e-3], r  # layer 0, layer 1, the final norm
        assert r["merged"], r
        assert r["own_extra"] == {"stage": r["rank"]} and r["dp_extra"] == {"stage": 0}, r
        assert all(r["habits"].values()), r["habits"]
    assert rows[0]["rates"] != rows[1]["rates"]  # the stages' groups did differ
    assert len(rows[0]["warned"]) == 1 and not rows[1]["warned"]


def _single_rank(model, batch):
    """The local rank's runner of a one-rank program, no process group needed."""
    from autopart.runtime.runner import Runner, local_weights

    program = autopart.parallelize(model, autopart.Mesh(), batch)
    rp = program.rank(0)
    return Runner(rp, program.plan, local_weights(program, rp), {})


def test_labels_follow_the_model_and_the_other_convention_is_refused() -> None:
    """HF models take HF's labels (unshifted; collator-style labels used to train the model to
    copy its input); pre-shifted labels given to an HF model, or labels equal to input_ids given
    to a model that takes shifted ones, are refused instead of trained on."""
    import hf_llama
    import nanogpt
    import torch.nn.functional as F

    from autopart.api import label_convention

    model, (ids, shifted) = hf_llama.make()
    model = model.double()
    assert label_convention(model) == "hf"
    runner = _single_rank(model, (ids, shifted))
    runner.label_convention = "hf"  # what parallelize sets on a live mesh
    hf = ids.clone()
    hf[:2, -5:] = -100
    with torch.no_grad():
        logits = model(ids).logits[:, :-1]
        want = F.cross_entropy(logits.flatten(0, 1), hf[:, 1:].flatten(), ignore_index=-100)
    got = runner.evaluate(ids, hf)
    assert abs(float(got) - float(want)) <= 1e-12 * float(want)
    with pytest.raises(autopart.AutopartError, match="already shifted"):
        runner.step(ids, shifted)
    assert torch.isfinite(runner.step(ids, shifted, shifted=True))  # explicitly pre-shifted
    constant = torch.full_like(ids, 5)  # reads both ways: HF's labels = input_ids, accepted
    assert torch.isfinite(runner.step(constant, constant.clone()))  # (was "already shifted")

    gpt, batch = nanogpt.make()
    assert label_convention(gpt) == "shifted"
    plain = _single_rank(gpt, batch)
    with pytest.raises(autopart.AutopartError, match="copy its input"):
        plain.step(batch[0], batch[0].clone())
    assert torch.isfinite(plain.step(batch[0], batch[0].clone(), shifted=False))
    constant = torch.full_like(batch[0], 5)
    assert torch.isfinite(plain.step(constant, constant.clone()))


@pytest.mark.slow
@pytest.mark.multirank
def test_the_example_loop_trains_resumes_and_saves_a_loadable_model(tmp_path: Path) -> None:
    """examples/train_hf.py under torchrun (tp2 x pp2): 4 steps with eval and checkpoints, then
    a second launch resumes from step 4 and goes on to 6; the saved model loads into HF Llama
    and holds the trained weights (its loss on a batch is below the first step's)."""
    import subprocess

    def launch(steps: int) -> str:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
        cmd += [str(ROOT / "examples" / "train_hf.py"), "--steps", str(steps)]
        cmd += ["--eval-every", "2", "--save-every", "2", "--out", str(tmp_path)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    first = launch(4)
    losses = [
        float(x.split()[3])
        for x in first.splitlines()
        if x.startswith("step") and " loss " in x and "val" not in x
    ]
    assert len(losses) == 4 and losses[-1] < losses[0], first
    second = launch(6)
    assert "resumed from" in second and "step00000004" in second, second
    assert "step    5" in second and "step    1 " not in second, second
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tmp_path / "model")
    ids = torch.tensor([list(b"the quick brown fox jumps over the lazy dog, again and again")])
    loss = float(model(ids, labels=ids).loss)
    assert loss < losses[0], (loss, losses)
