"""Run on 2 forked ranks by tests/test_zero_bubble.py: work while waiting (``Channel.filler``).

A zero-bubble step (nanoGPT, float64, pp=2, 4 micro-batches) whose rank 0 sleeps 0.3 s before
each forward after the first, so rank 1 waits for every activation but the first while it holds
the previous unit's deferred weight gradients. Under ``zb-h1`` and ``seq1f1b-zb`` (k = 2), the
step runs twice: with the filler (the runtime's default) and without it. Prints one JSON line
on rank 1: how many GEMMs ran while waiting, whether every receive's trace event starts after
the pieces of W run inside it, and whether the two steps' loss and gradients are equal bit for
bit (each parameter's gradient adds up in the same order either way).
"""

import json
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopart
from autopart.models.nanogpt import make
from autopart.runtime.runner import Runner


def main() -> int:
    dist.init_process_group("gloo")
    me = dist.get_rank()
    torch.set_default_dtype(torch.float64)
    model, batch = make()
    model = model.double()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    forward = Runner._HANDLERS["F"]

    def late(self, i, action, unit):  # rank 0 runs late: rank 1 waits for its activations
        if action.mb > 0:
            time.sleep(0.3)
        forward(self, i, action, unit)

    if me == 0:
        Runner._HANDLERS["F"] = late
    out = {}
    for schedule, k in (("zb-h1", 1), ("seq1f1b-zb", 2)):
        runner = autopart.parallelize(
            model, mesh, example_inputs=batch, schedule=schedule, microbatches=4, seq_chunks=k
        )
        runner.timeline = []
        runs = []
        for fill in (True, False):
            runner._p2p.filler = runner._fill if fill else None
            for p in runner.parameters():
                p.grad = None
            loss = runner.step(*batch)
            grads = {f: p.grad.clone() for f, p in runner.named_parameters()}
            runs.append((loss, grads, replace(runner.stats), list(runner.timeline)))
        (loss, grads, stats, events), (loss0, grads0, stats0, _) = runs
        pieces = [ev for ev in events if ev.action.kind == "W"]
        recvs = [ev for ev in events if ev.action.kind in ("RECV_F", "RECV_B")]
        out[schedule] = {
            "filled": stats.filled_gemms,
            "filled_without": stats0.filled_gemms,
            "deferred": [stats.deferred_gemms, stats0.deferred_gemms],
            "w_events": len(pieces),
            "units": 4 * k,
            "no_overlap": all(
                not (w.start < r.end and r.start < w.end) for w in pieces for r in recvs
            ),
            "bitwise": bool(loss == loss0) and all(torch.equal(grads[f], grads0[f]) for f in grads),
        }
    if me == 1:
        print(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
