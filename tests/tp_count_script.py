"""Run under torchrun (2 ranks) by tests/test_multirank.py: count the collectives of one
tensor-parallel step as they really run, with and without sequence parallelism.

nanoGPT-style model, 2 blocks, hidden h=32, batch b=8, sequence s=32, vocab V=96, tp=2.
Prints one JSON line per mode on rank 0: the (kind, shape) of every collective, in order.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import nanogpt  # noqa: E402

import autopart  # noqa: E402
from autopart.meta import META_DROPOUT_SPLIT  # noqa: E402
from autopart.runtime.comm import Comm  # noqa: E402

LOG: list | None = None  # (kind, group, shape) of every collective while a list


def _counted(kind: str, run, group_at: int):
    """``run`` (one of the runtime context's collectives, ``Comm.all_reduce`` ...), recording
    each call while LOG is a list: (kind, group name, shape)."""

    def call(comm, x, *args, **kwargs):
        if LOG is not None:
            LOG.append((kind, args[group_at], tuple(x.shape)))
        return run(comm, x, *args, **kwargs)

    return call


Comm.all_reduce = _counted("all_reduce", Comm.all_reduce, 0)
Comm.all_gather = _counted("all_gather", Comm.all_gather, 1)
Comm.reduce_scatter = _counted("reduce_scatter", Comm.reduce_scatter, 1)


def main() -> int:
    global LOG
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for sp in (False, True):
        model, batch = nanogpt.make()
        runner = autopart.parallelize(
            model.double(), mesh, example_inputs=batch, sequence_parallel=sp
        )
        log = LOG = []
        runner.step(*batch)
        LOG = None
        if dist.get_rank() == 0:
            print(
                json.dumps({"sp": sp, "calls": [[k, list(s)] for k, g, s in log if g == "tp"]}),
                flush=True,
            )
    # dropout (p=0.2, manual attention): replicated activations must stay identical on both tp
    # ranks (same masks), so every replicated parameter's gradient is bitwise equal across them
    model, batch = nanogpt.make(dropout=0.2, attention="manual")
    runner = autopart.parallelize(model.double(), mesh, example_inputs=batch)
    runner.step(*batch)
    # the pass's marks, read off the compiled program (the live runner's graphs were handed over
    # from rank 0 as saved files, which keep no pass metadata)
    offline = autopart.parallelize(model.double(), autopart.Mesh(tp=2), batch)
    split = [
        n.meta[META_DROPOUT_SPLIT]
        for n in offline.rank(0).stages[0].graph.graph.nodes
        if META_DROPOUT_SPLIT in n.meta
    ]
    same = []
    for fqn, p in runner.named_parameters():
        if runner.program.shards[fqn].dim is None:
            both = [p.grad.clone() for _ in range(2)]
            dist.all_gather(both, p.grad.contiguous())
            same.append(bool(torch.equal(both[0], both[1])))
    if dist.get_rank() == 0:
        print(json.dumps({"dropout_split": split, "replicated_grads_equal": same}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown (see autopart/runtime/run.py)
