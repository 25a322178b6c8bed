"""Run on 2 forked ranks by tests/test_multirank.py: ranks that do not make the same collective
calls, as a distributed loop does by accident (runtime/meet.py). Each case gets a runner of its
own (a refused meeting leaves the ranks' counts apart), and a short ``timeout_s``.

- One rank in ``evaluate``, the other in ``step``: gloo aborted a process over the messages'
  sizes ("EnforceNotMet … 30592 vs 4"). Both are refused at once, each naming the other's call.
- Rank 0 alone in ``full_state_dict`` (DDP's "save on rank 0"): it waited in an
  ``all_gather_object`` with no timeout (30 minutes of gloo's). Refused after ``timeout_s``,
  naming rank 1 and the last call it came to, with nothing left pending (the process exits).
- Another model on rank 1 (one more layer): the broadcast aborted, hung or overwrote part of a
  wider model silently. Refused on both ranks at ``parallelize``, with both models' sizes.
- A local share that does not split into the micro-batches on rank 1 only: rank 1 alone said so
  (of a batch size it was never given), rank 0 saw a closed connection. Refused on both, naming
  rank 1's rows.
- Rank 1 skips one ``optimizer.step()``: the dp replicas' weights drifted apart, silently. The
  next call samples every parameter's first element on each rank and refuses on every rank.
- A runner used after ``destroy_process_group()``: a raw ``ValueError``; now named.

Prints one JSON line per rank.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopart
from autopart.models import nanogpt


def error_of(fn) -> str:
    """The text of ``fn``'s ``AutopartError``, or "" when it ran."""
    try:
        fn()
    except autopart.AutopartError as exc:
        return str(exc)
    return ""


def main() -> dict:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, batch = nanogpt.make()
    out: dict = {"rank": rank}

    def runner(m=model):
        return autopart.parallelize(m, mesh, batch, microbatches=2, timeout_s=60.0)

    r = runner()
    out["step_vs_evaluate"] = error_of(lambda: (r.evaluate if rank else r.step)(*batch))

    r = runner()
    r.step(*batch)
    r.timeout_s = 3.0  # (not at parallelize: rank 0's compile may take longer on a busy host)
    start = time.monotonic()
    out["alone"] = error_of(r.full_state_dict) if rank == 0 else ""
    out["alone_s"] = time.monotonic() - start
    dist.barrier()  # rank 1 waits here, outside autopart, until rank 0 is refused

    other, _ = nanogpt.make(n_layer=3) if rank == 1 else (model, None)
    out["models"] = error_of(lambda: runner(m=other))

    r = runner()
    ids, labels = (t[rank * 4 : rank * 4 + (3 if rank else 4)] for t in batch)
    out["share"] = error_of(lambda: r.step(ids, labels, local=True))

    r = runner()
    opt = torch.optim.SGD(r.parameters(), lr=0.1)
    r.step(*batch)
    if rank == 0:  # rank 1 skips one optimizer step: the replicas' weights part
        opt.step()
    opt.zero_grad()
    out["drift"] = error_of(lambda: r.step(*batch))

    r = runner(m=nanogpt.make()[0])  # (the module above trained: a fresh one)
    dist.destroy_process_group()
    out["destroyed"] = error_of(lambda: r.step(*batch))
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    print(json.dumps(main()), flush=True)
    sys.exit(0)
