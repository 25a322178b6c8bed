"""Run on 2 forked ranks (pp=2) by tests/test_training_loop.py: what a pipeline stage holds of
an optimizer. HF Llama with tied embeddings, the embedding frozen (fine-tuning), AdamW with
weight decay and one group per layer at its own learning rate (layer-wise decay), built from
the parameters each rank holds: the stages' groups differ.

- The frozen tied weight keeps no gradient (None, as on one device) and does not move: a zero
  gradient used to let weight decay move it.
- A checkpoint saved under pp=2 and loaded into an optimizer of the same groups at other rates
  gives each stage back its own rates (every rank used to get rank 0's).
- Loaded under dp=2 (every layer on each rank), each layer's group takes the rate it trained
  with; a group merging layers saved at different rates is refused, naming both.
- Each rank's own ``extra`` comes back to it under the same layout; under another, rank 0's,
  with a warning on rank 0.

Prints one JSON line per rank. Argument: a folder for the checkpoint."""

import json
import re
import sys
import warnings

import torch
import torch.distributed as dist
from refusals import refused
from torch.distributed.device_mesh import init_device_mesh

import autopart
from autopart import checkpoint


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).double()
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def layer(fqn: str) -> int:
    m = re.search(r"layers\.(\d+)\.", fqn)
    return int(m.group(1)) if m else 2  # the final norm


def optimizer(runner, rates=None, merged: bool = False):
    groups: dict[int, list] = {}
    for fqn, p in runner.named_parameters():
        if p.requires_grad:
            groups.setdefault(0 if merged else layer(fqn), []).append(p)
    return torch.optim.AdamW(
        [
            {"params": ps, "lr": (rates or {}).get(i, 1e-3 * 2**i)}
            for i, ps in sorted(groups.items())
        ],
        weight_decay=0.1,
    )


def main() -> int:
    dist.init_process_group("gloo")
    root = sys.argv[1]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (4, 16), generator=g)
    model = build()
    frozen_before = model.model.embed_tokens.weight.detach().clone()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    runner = autopart.parallelize(model, mesh, example_inputs=(ids, ids), microbatches=2)
    opt = optimizer(runner)
    runner.step(ids, ids)
    tied = [f for f, p in runner.named_parameters() if not p.requires_grad]
    frozen_grads = [runner.params[f].grad is None for f in tied]
    opt.step()
    frozen_moved = max(float((runner.params[f].detach() - frozen_before).abs().max()) for f in tied)
    rates = [grp["lr"] for grp in opt.param_groups]
    checkpoint.save(root, runner, opt, step=1, extra={"stage": dist.get_rank()})
    again = optimizer(runner, rates={i: 1.0 for i in range(3)})
    own_extra = checkpoint.load(root, runner, again)["extra"]
    back = [grp["lr"] for grp in again.param_groups]

    # the ranks disagree: every rank refuses alike, none waits for the others (a count or an
    # extra only one rank has used to crash it with a raw IndexError, or hang its peer)
    rank = dist.get_rank()
    trained = [p for p in runner.parameters() if p.requires_grad]
    halves = [torch.optim.AdamW(trained[:1]), torch.optim.AdamW(trained[1:])]
    habits = {
        "optimizer_counts": refused(
            lambda: checkpoint.save(root + "-x", runner, halves if rank == 0 else opt),
            "rank 0 passes the optimizers ['AdamW', 'AdamW'], rank 1 ['AdamW']",
        ),
        "extra_nan": refused(
            lambda: checkpoint.save(
                root + "-x", runner, opt, extra={"x": float("nan") if rank else 0.0}
            ),
            "rank 1: checkpoint extra is not JSON-able",
        ),
        # only stage 1 holds a group of layers saved at different rates: both refuse it
        "one_rank_refuses": refused(
            lambda: checkpoint.load(root, runner, optimizer(runner, merged=rank == 1)),
            "rank 1: optimizer parameter group 0 holds",
        ),
    }
    # a tensor learning rate comes back as a tensor (its number used to be left out)
    tensor_lr = torch.optim.AdamW(
        [p for p in runner.parameters() if p.requires_grad],
        lr=torch.tensor(3e-4, dtype=torch.float64),
    )
    checkpoint.save(root + "-t", runner, tensor_lr, step=1)
    tensor_lr.param_groups[0]["lr"].fill_(7e-3)
    checkpoint.load(root + "-t", runner, tensor_lr)
    habits["tensor_lr"] = float(tensor_lr.param_groups[0]["lr"]) == 3e-4

    model = build()
    flat = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    whole = autopart.parallelize(model, flat, example_inputs=(ids, ids))
    every = optimizer(whole, rates={i: 1.0 for i in range(3)})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        dp_extra = checkpoint.load(root, whole, every)["extra"]
    merged = refused(
        lambda: checkpoint.load(root, whole, optimizer(whole, merged=True)),
        "trained with different hyperparameters",
    )
    print(
        json.dumps(
            {
                "rank": dist.get_rank(),
                "tied": tied,
                "frozen_grads_none": frozen_grads,
                "frozen_moved": frozen_moved,
                "rates": rates,
                "back": back,
                "dp_rates": [grp["lr"] for grp in every.param_groups],
                "merged": merged,
                "own_extra": own_extra,
                "dp_extra": dp_extra,
                "warned": [str(w.message) for w in said if "its own extra" in str(w.message)],
                "habits": habits,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
