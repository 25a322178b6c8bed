"""Run on 4 forked ranks by tests/test_training_loop.py: an ordinary training loop around the
live API, as a user used to DDP would write it, against the same loop on one process.

Each rank builds HF Llama (tied embeddings, a module the forward never uses, a frozen final
norm) from its
*own* seed: parallelize must start every rank from rank 0's weights. The loop: AdamW with decay groups (weight decay on matrices only),
linear warmup, gradient clipping that bites every step (``Runner.clip_grad_norm_``, and every
other step torchtitan's ``clip_grads_with_norm_`` handed ``runner.grad_norm()``), 8 steps on
batches with Hugging Face's labels (unshifted, ``labels = input_ids``) ending in unequal runs of
-100; the reference is HF's loss definition, in float64. Every step's loss and grad norm, and every
final weight, are compared with the single-process loop on rank 0's model in float64. Prints
one JSON line per rank. Argument: the mesh, ``dp2pp2`` or ``tp2pp2``.
"""

import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from refusals import refused
from torch.distributed.device_mesh import init_device_mesh

import autopart
import autopart.api

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

STEPS, MAX_NORM, LR = 8, 0.05, 1e-2


def build(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        use_cache=True,  # HF's default: capture turns it off itself
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).double()
    # a module the forward never uses: one device leaves its gradient None, so AdamW neither
    # moves nor decays it; it must be held by some rank, and come back in full_state_dict
    model.unused = torch.nn.Linear(16, 16).double()
    # a frozen parameter (fine-tuning): it must stay frozen on every rank; it used to come back
    # trainable from the program rank 0 hands the others (the program did not record it)
    model.model.norm.weight.requires_grad_(False)
    return model


def batches():
    """Hugging Face style: labels = input_ids (unshifted), -100 on unequal padding."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 96, (8, 32), generator=g)
        labels = ids.clone()
        for i in range(8):  # unequal padding: 0..7 ignored positions at the end
            if i:
                labels[i, -i:] = -100
        out.append((ids, labels))
    return out


def hf_loss(model, ids, labels):
    """Hugging Face's causal-LM loss (logits at t against labels at t + 1, mean over labels !=
    -100), in the model's dtype: HF's own computes it in float32, which float64 parity cannot
    use."""
    logits = model(ids).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def optimizer(named):
    named = list(named)
    decay = [p for _, p in named if p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=LR
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return opt, sched


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = {"dp2pp2": ("pp", "dp"), "tp2pp2": ("pp", "tp")}[sys.argv[1]]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
    model = build(seed=100 + rank)  # a different model on every rank
    data = batches()
    captures = []  # the live API compiles once, on rank 0: the others capture nothing
    real_capture = autopart.api.capture
    autopart.api.capture = lambda *a, **k: captures.append(1) or real_capture(*a, **k)
    t0 = time.perf_counter()
    runner = autopart.parallelize(model, mesh, example_inputs=data[0], microbatches=2)
    parallelize_s = time.perf_counter() - t0
    autopart.api.capture = real_capture
    ref = copy.deepcopy(model)  # rank 0's model now, on every rank
    got_losses, got_norms = [], []
    opt, sched = optimizer(runner.named_parameters())
    for i, (ids, labels) in enumerate(data):
        got_losses.append(float(runner.step(ids, labels)))
        if i % 2:
            got_norms.append(runner.clip_grad_norm_(MAX_NORM))
        else:  # torchtitan's two calls, handed the whole model's norm
            got_norms.append(runner.grad_norm())
            norm = torch.tensor(got_norms[-1], dtype=torch.float64)  # the model's dtype
            torch.nn.utils.clip_grads_with_norm_(runner.parameters(), MAX_NORM, norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    ref_losses, ref_norms = [], []
    ropt, rsched = optimizer(ref.named_parameters())
    for ids, labels in data:
        loss = hf_loss(ref, ids, labels)
        loss.backward()
        ref_losses.append(float(loss))
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        ropt.step()
        rsched.step()
        ropt.zero_grad(set_to_none=True)
    full = dict(ref.named_parameters())
    weight_err = 0.0
    for fqn, p in runner.named_parameters():
        want = runner.program.shards[fqn].local(full[fqn].detach())
        weight_err = max(weight_err, float((p.detach() - want).abs().max() / want.abs().max()))

    # nn.Module's habits: zero_grad (to zeros, then to None), and a clear error for a call
    runner.step(*data[0])
    runner.zero_grad(set_to_none=False)
    grads = [p.grad for p in runner.parameters() if p.grad is not None]  # the unused: None
    zeroed = len(grads) >= len(list(runner.parameters())) - 2 and not any(g.any() for g in grads)
    runner.zero_grad()
    try:
        runner(*data[0])
        call_refused = False
    except autopart.AutopartError as exc:
        call_refused = "runner.step(input_ids, labels)" in exc.message

    # validation in eval mode: forward only, the same loss as the model's, no gradient touched
    runner.eval()
    ref.eval()
    ids, labels = data[0]
    with torch.no_grad():
        want = hf_loss(ref, ids, labels)
    eval_err = abs(float(runner.evaluate(ids, labels)) - float(want)) / float(want)
    grads_untouched = all(p.grad is None for p in runner.parameters())
    with torch.no_grad():  # logits for sampling: the model's own, on every rank
        want_logits = ref(ids).logits
    got_logits = runner.logits(ids)
    logits_err = float((got_logits - want_logits).abs().max() / want_logits.abs().max())
    runner.train()
    # a model with dropout (nanoGPT, manual attention, p = 0.3), in eval mode when parallelize
    # sees it (as from_pretrained leaves one): the live API captures the training graph anyway,
    # and the runner follows the module's mode, as a DDP-wrapped module does
    import nanogpt

    drop, drop_batch = nanogpt.make(attention="manual", dropout=0.3)
    drop = drop.double().eval()
    drop_runner = autopart.parallelize(drop, mesh, example_inputs=drop_batch, microbatches=2)
    with torch.no_grad():
        dwant = F.cross_entropy(
            drop(drop_batch[0]).flatten(0, 1), drop_batch[1].flatten(), ignore_index=-100
        )
    dgot = float(drop_runner.evaluate(*drop_batch))  # the module is in eval mode: no dropout
    dropout_eval_err = abs(dgot - float(dwant)) / float(dwant)
    drop.train()  # model.train(): the runner's dropout is on again
    train_loss = float(drop_runner.evaluate(*drop_batch))
    runner_eval = float(drop_runner.eval().evaluate(*drop_batch))  # runner.eval(): as well
    modes_follow = not drop.training and abs(runner_eval - dgot) <= 1e-12 * abs(dgot)
    drop_runner.train()
    modes_follow = modes_follow and drop.training

    # habits right on one device and wrong here: each refused where it happens
    def under(ctx):
        def run():
            with ctx:
                runner.step(*data[0])

        return run

    loss = runner.step(*data[0])
    habits = {  # pp=2 in both meshes: torch's norm clipping would see one stage's gradients
        # DDP's loss.backward(): step ran it (torch said "backward through the graph a second
        # time", hinting at retain_graph); the loss logs and saves as a plain tensor
        "loss_backward": refused((loss / 2).backward, "ran the forward and the backward")
        and type(copy.deepcopy(loss).as_subclass(torch.Tensor)) is torch.Tensor
        and repr(loss).startswith("tensor("),
        "torch_clip": refused(
            lambda: torch.nn.utils.clip_grad_norm_(runner.parameters(), 1.0),
            "runner.clip_grad_norm_(max_norm)",
        ),
        "torch_clip_list": refused(  # torchtitan's: a list, which no iterator check sees
            lambda: torch.nn.utils.clip_grad_norm_(list(runner.parameters()), 1.0),
            "runner.clip_grad_norm_(max_norm)",
        ),
        "torchtitan_clip": refused(  # get_total_norm over this rank's gradients: its norm
            lambda: torch.nn.utils.clip_grads_with_norm_(
                runner.parameters(),
                1.0,
                torch.nn.utils.get_total_norm(
                    [p.grad for p in runner.parameters() if p.grad is not None]
                ),
            ),
            "torch.tensor(runner.grad_norm())",
        ),
        "clip_value_allowed": torch.nn.utils.clip_grad_value_(runner.parameters(), 1e9) is None,
        "model_optimizer": refused(  # refused when built now, at its step before training
            lambda: torch.optim.SGD(model.parameters(), lr=0.1).step(), "from runner.parameters()"
        ),
        "autocast": refused(under(torch.autocast("cpu", dtype=torch.bfloat16)), 'precision="bf16"'),
        "no_grad": refused(under(torch.no_grad()), "runner.evaluate"),
        # DDP's sampler habit: every rank its own rows (the pp peers then disagree)
        "batch_per_rank": refused(lambda: runner.step(*data[rank]), "passed another batch"),
        "batch_per_rank_local": refused(
            lambda: runner.step(*data[rank], local=True), "passed another batch"
        ),
        # one rank alone passes another batch (it drew a sample for logging): every rank
        # refuses at once (the ranks of the groups that agreed used to wait for the timeout)
        "one_rank_differs": refused(
            lambda: runner.step(*data[1 if rank == 0 else 0]), "passed another batch"
        ),
        # each rank its own num_tokens: the ranks would average by different counts
        "num_tokens_per_rank": refused(
            lambda: runner.step(*data[0], num_tokens=10_000 + rank), "passed num_tokens="
        ),
    }
    # a tokenizer's int32 ids train as int64 (they crashed dp's loss with a raw ATen message);
    # float ids are refused by name
    with torch.no_grad():
        want_int = float(runner.evaluate(*data[0]))
    habits["int32_ids"] = float(runner.evaluate(*(t.int() for t in data[0]))) == want_int
    habits["float_ids"] = refused(
        lambda: runner.step(data[0][0].double(), data[0][1]), "token ids are integers"
    )
    # a sampler per dp replica (local=True): the replicas differ, the pp peers agree
    share = [t[runner.dp_rank * 4 : (runner.dp_rank + 1) * 4] for t in data[0]]
    habits["batch_per_replica"] = bool(torch.isfinite(runner.step(*share, local=True)))
    runner.zero_grad()
    # the module's weights are the ones from before parallelize until copy_to: reading them
    # once the runner has trained is refused (it returned the initial weights, silently)
    habits["module_call_behind"] = refused(lambda: model(data[0][0]), "runner.copy_to(model)")
    habits["module_state_dict_behind"] = refused(model.state_dict, "runner.copy_to(model)")
    habits["module_copy_behind"] = refused(lambda: copy.deepcopy(model), "runner.copy_to(model)")
    # torch's clipping over the module's parameters (no gradients there) clipped nothing
    runner.step(*data[0])
    habits["clip_model_params"] = refused(
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), "runner.clip_grad_norm_"
    )
    # ZeRO over the default (world) group: its other ranks hold other stages, and its step's
    # broadcasts hung every rank; refused before it changes anything
    from torch.distributed.optim import ZeroRedundancyOptimizer

    habits["zero_world_group"] = refused(
        lambda: ZeroRedundancyOptimizer(
            list(runner.parameters()), optimizer_class=torch.optim.SGD, lr=0.0
        ).step(),
        "hold other parameters than this rank",
    )
    # model.zero_grad() clears the runner's gradients too (they used to add up over steps)
    model.zero_grad()
    habits["model_zero_grad_follows"] = all(p.grad is None for p in runner.parameters())
    # a parameter frozen after parallelize would go on training: the next step is refused
    model.lm_head.weight.requires_grad_(False)
    habits["frozen_after"] = refused(lambda: runner.step(*data[0]), "after parallelize")
    model.lm_head.weight.requires_grad_(True)

    # the whole model back: strictly into a fresh model, and into the user's own module
    sd = runner.full_state_dict()
    fresh = build(seed=999)
    fresh.load_state_dict(sd, strict=True)
    want_sd = ref.state_dict()
    sd_err = max(
        float((sd[k] - v).abs().max() / max(v.abs().max(), 1e-30)) for k, v in want_sd.items()
    )
    # load_state_dict: the model's whole state dict, as nn.Module's (each rank cuts its
    # slices); a rank's own state_dict() round-trips; a key the model lacks is refused
    mine = {k: v.clone() for k, v in runner.state_dict().items()}
    runner.load_state_dict(build(seed=998).state_dict())
    changed = any(not torch.equal(runner.state_dict()[k], v) for k, v in mine.items())
    loaded = runner.load_state_dict(sd)
    own = runner.state_dict()  # under tp: slices, whose rank cannot be told: refused
    own_ok = (
        refused(lambda: runner.load_state_dict(own), "a tp rank's slice")
        if runner.plan.mesh.tp > 1
        else runner.load_state_dict(own).missing_keys == []
    )
    load_state = (
        changed
        and own_ok
        and not loaded.missing_keys
        and not loaded.unexpected_keys
        and all(torch.equal(runner.state_dict()[k], v) for k, v in mine.items())
        and refused(
            lambda: runner.load_state_dict({**sd, "nope": torch.zeros(1)}),
            "keys the model does not have",
        )
    )
    runner.copy_to(model)
    copy_err = max(
        float((model.state_dict()[k] - v).abs().max() / max(v.abs().max(), 1e-30))
        for k, v in want_sd.items()
    )
    # the module's own reference loop (it is current again, and has gradients) is not refused
    hf_loss(model, *data[0]).backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    model.zero_grad()
    habits["module_own_loop"] = True

    def rel(a, b):
        return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))

    print(
        json.dumps(
            {
                "rank": rank,
                "loss_err": rel(got_losses, ref_losses),
                "norm_err": rel(got_norms, ref_norms),
                "weight_err": weight_err,
                "zero_grad": zeroed,
                "call_refused": call_refused,
                "state_dict_err": sd_err,
                "copy_to_err": copy_err,
                "keys_match": sorted(sd) == sorted(want_sd),
                "eval_err": eval_err,
                "logits_err": logits_err,
                "logits_shape": list(got_logits.shape),
                "grads_untouched": grads_untouched,
                "dropout_eval_err": dropout_eval_err,
                "dropout_train_differs": abs(train_loss - float(dwant)) > 1e-6,
                "modes_follow": modes_follow,
                "habits": habits,
                "load_state": load_state,
                "clipped": sum(n > MAX_NORM for n in ref_norms),
                "losses": got_losses,
                "captures": len(captures),
                "parallelize_s": parallelize_s,
            }
        ),
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
