"""Run on 2 forked ranks by tests/test_guards.py: ``evaluate`` and ``logits`` of lengths
sequence parallelism cannot split, under tp = 2 with SP and Seq1F1B (4 chunks).

nanoGPT in float64, captured at 32 tokens. Lengths 31, 33 and 35: each is padded to a length
tp divides and the program cuts, with copies of its last token (labels -100), and cut back
(33 used to pass the chunk check, 8 + 8 + 8 + 9, and be refused by the SP check). Prints one
JSON line on rank 0: the worst logits and loss error against the model, and whether a step of
33 tokens is refused.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import autopart
from autopart.models.nanogpt import make


def main() -> int:
    dist.init_process_group("gloo")
    model, (ids, labels) = make()
    model = model.double().eval()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    runner = autopart.parallelize(
        model, mesh, (ids, labels), schedule="seq1f1b", seq_chunks=4, sequence_parallel=True
    )
    ids = torch.cat([ids, ids[:, :8]], 1)
    labels = torch.cat([labels, labels[:, :8]], 1)
    worst, runner_eval = 0.0, runner.eval()
    for seq in (31, 33, 35):
        with torch.no_grad():
            want = model(ids[:, :seq])
            want = want[0] if isinstance(want, tuple) else want
            ref = F.cross_entropy(want.flatten(0, 1), labels[:, :seq].flatten())
        got = runner_eval.logits(ids[:, :seq])
        loss = runner_eval.evaluate(ids[:, :seq], labels[:, :seq])
        worst = max(
            worst,
            float((got - want).abs().max() / want.abs().max()),
            abs(float(loss) - float(ref)) / float(ref),
        )
    runner.train()
    try:
        runner.step(ids[:, :33], labels[:, :33])
        refused = False
    except autopart.AutopartError as exc:
        refused = "not divisible by tp=2" in exc.message
    if dist.get_rank() == 0:
        print(json.dumps({"worst": worst, "step_refused": refused}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)
