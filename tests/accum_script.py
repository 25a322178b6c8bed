"""Run on 2 forked ranks (dp=2) by tests/test_training_loop.py: gradient accumulation. Two
``step`` calls, the first inside ``no_sync()``, each told the token count of both
(``num_tokens``), must leave the gradients one step on both batches together leaves, even
with unequal -100 padding (each call's own mean would weight them wrongly). And a step on each
rank's own share (``local=True``) equals the step on the global batch. Prints one JSON line per
rank."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import nanogpt  # noqa: E402
from refusals import refused  # noqa: E402

import autopart  # noqa: E402


def main() -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, (ids, labels) = nanogpt.make()
    model = model.double()
    labels[:4, -20:] = -100  # the first half of the batch is mostly padding
    runner = autopart.parallelize(model, mesh, example_inputs=(ids[:4], labels[:4]))
    a, b = (ids[:4], labels[:4]), (ids[4:], labels[4:])
    total = int((labels != -100).sum())
    with runner.no_sync():
        runner.step(*a, num_tokens=total)
    local_after_first = {f: p.grad.clone() for f, p in runner.named_parameters()}
    runner.step(*b, num_tokens=total)
    accumulated = {f: p.grad.clone() for f, p in runner.named_parameters()}
    for p in runner.parameters():
        p.grad = None
    whole = autopart.parallelize(model, mesh, example_inputs=(ids, labels))
    whole.step(ids, labels)
    want = dict(whole.named_parameters())
    err = max(
        float((accumulated[f] - want[f].grad).abs().max() / want[f].grad.abs().max())
        for f in accumulated
    )
    # each rank loads only its own share of the global batch (local=True): the same step
    for p in whole.parameters():
        p.grad = None
    r = whole.dp_rank
    rows = slice(r * 4, (r + 1) * 4)
    local_loss = whole.step(ids[rows], labels[rows], local=True)
    local_err = max(
        float((p.grad - want[f].grad).abs().max() / want[f].grad.abs().max())
        for f, p in whole.named_parameters()
    )
    for p in whole.parameters():
        p.grad = None
    global_loss = whole.step(ids, labels)
    local_err = max(local_err, abs(float(local_loss) - float(global_loss)) / float(global_loss))
    # num_tokens is the count of all the accumulated global batches: a replica's own count
    # (local=True) took the mean over half the labels, and replicas passing different counts
    # averaged differently, silently; both are refused on every rank alike
    share = (ids[rows], labels[rows])
    own = int((labels[4:] != -100).sum())  # one replica's count, passed alike by both

    tokens = {
        "replica_count": refused(
            lambda: whole.step(*share, local=True, num_tokens=own), "fewer than this step's own"
        ),
        "replicas_differ": refused(
            lambda: whole.step(*share, local=True, num_tokens=total + r), "passed num_tokens="
        ),
        "not_whole": refused(lambda: whole.step(ids, labels, num_tokens=2.5), "whole number"),
    }
    # every step inside no_sync(): the gradients were never reduced over dp, and clipping or
    # an optimizer step used each replica's own (the replicas drifted apart)
    for p in whole.parameters():
        p.grad = None
    with whole.no_sync():
        whole.step(ids, labels)
    opt = torch.optim.SGD(whole.parameters(), lr=0.0)
    tokens["no_sync_clip"] = refused(lambda: whole.clip_grad_norm_(1.0), "inside runner.no_sync")
    tokens["no_sync_opt_step"] = refused(opt.step, "inside runner.no_sync")
    whole.zero_grad()
    opt.step()  # nothing unreduced is left
    # gradients of steps without num_tokens add up: said once, by a warning
    import warnings

    for p in whole.parameters():
        p.grad = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        whole.step(ids, labels)
        first = len(seen)
        whole.step(ids, labels)
        whole.step(ids, labels)
    said = [str(w.message) for w in seen if "num_tokens" in str(w.message)]
    tokens["sum_warned_once"] = first == 0 and len(said) == (1 if dist.get_rank() == 0 else 0)
    # inside no_sync the two replicas' gradients stayed their own (not yet reduced)
    mine = torch.cat([g.reshape(-1) for g in local_after_first.values()])
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    unreduced = not torch.equal(both[0], both[1])
    print(
        json.dumps(
            {
                "rank": dist.get_rank(),
                "err": err,
                "unreduced": unreduced,
                "local_err": local_err,
                "tokens": tokens,
            }
        ),
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
