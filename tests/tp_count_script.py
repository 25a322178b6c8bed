"""Run under torchrun (2 ranks) by tests/test_multirank.py: count the collectives of one
tensor-parallel step as they really run, with and without sequence parallelism.

nanoGPT-style model, 2 blocks, hidden h=32, batch b=8, sequence s=32, vocab V=96, tp=2.
Prints one JSON line per mode on rank 0: the (kind, shape) of every collective, in order.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import nanogpt  # noqa: E402

import autopart  # noqa: E402
from autopart import collectives  # noqa: E402


def main() -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for sp in (False, True):
        model, batch = nanogpt.make()
        runner = autopart.parallelize(
            model.double(), mesh, example_inputs=batch, sequence_parallel=sp
        )
        log = collectives.trace()
        runner.step(*batch)
        collectives.trace(False)
        if dist.get_rank() == 0:
            print(
                json.dumps({"sp": sp, "calls": [[k, list(s)] for k, g, s in log if g == "tp"]}),
                flush=True,
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
