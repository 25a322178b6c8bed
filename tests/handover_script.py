"""Run on 2 forked ranks by tests/test_multirank.py: the live API's compile on rank 0, seen
from the others (``runtime/handover.py``).

1. Rank 0's compile raises: every rank raises an ``AutopartError``; the others quote rank 0's.
2. Rank 0's compile takes three times ``timeout_s`` (a deep model: minutes, against the
   default 300 s): the other ranks wait, hearing its beats, and every rank then trains one
   step equal to one device's.
3. The same on the same process group with a compile of a moment: nothing left over.

Prints one JSON line per rank.
"""

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import nanogpt  # noqa: E402

import autopart  # noqa: E402
import autopart.api  # noqa: E402
from autopart.parity.verify import reference, rel_error  # noqa: E402
from autopart.runtime import handover  # noqa: E402

TIMEOUT_S = 3.0


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model, batch = nanogpt.make()
    model = model.double()
    ref_loss, ref_grads = reference(model, batch)
    real_compile = autopart.api._compile
    handover.BEAT_S = 0.2

    def broken(*args):
        raise autopart.AutopartError("the model does not compile here")

    autopart.api._compile = broken
    try:
        autopart.parallelize(model, mesh, example_inputs=batch, timeout_s=TIMEOUT_S)
        failed = ""
    except autopart.AutopartError as exc:
        failed = exc.message
    waited = []

    def slow(*args):
        time.sleep(3 * TIMEOUT_S)
        return real_compile(*args)

    errs = []
    for compile_with in (slow, real_compile):
        autopart.api._compile = compile_with
        t0 = time.perf_counter()
        runner = autopart.parallelize(model, mesh, example_inputs=batch, timeout_s=TIMEOUT_S)
        waited.append(time.perf_counter() - t0)
        loss = runner.step(*batch)
        grads = max(rel_error(p.grad, ref_grads[f]) for f, p in runner.named_parameters())
        errs.append(max(abs(float(loss) - ref_loss) / abs(ref_loss), grads))
    row = {"rank": rank, "failed": failed, "waited": waited, "errs": errs}
    print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
