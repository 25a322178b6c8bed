"""Run on 2 forked ranks by tests/test_shm.py: the shared-memory transport against hostile
conditions. (1) A /dev/shm too small for the first data file: the setup probe fails on rank 1,
every rank falls back to the socket transport with a warning, and the sum is still right.
(2) A peer that dies outside any exchange (rank 1 exits between steps): rank 0 notices within
a second, not at the 300 s timeout, naming the rank and its process. Prints one JSON line on
rank 0."""

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from autopart import collectives
from autopart.errors import AutopartError
from autopart.runtime import shm
from autopart.runtime.comm import Comm

COMM = Comm()  # this script's runtime context (a Runner owns one)
collectives.activate(COMM)


def main() -> int:
    dist.init_process_group("gloo")
    me = dist.get_rank()
    out = {}
    mapping = shm._map
    if me == 1:  # the probe's data file cannot be reserved: a tiny /dev/shm

        def small(path: str, size: int, create: bool):
            if create and size > shm._CTL_BYTES:
                raise OSError(28, "No space left on device")
            return mapping(path, size, create)

        shm._map = small
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        COMM.bind("small", dist.new_group([0, 1]))
        out["small_transport"] = COMM.transport(COMM.group("small"))
    shm._map = mapping
    out["small_warned"] = any("no shared-memory transport" in str(w.message) for w in seen)
    out["small_sum"] = collectives._all_reduce(torch.ones(4), "small").tolist()

    COMM.bind("t", dist.new_group([0, 1]))
    COMM.set_action("step 1", timeout_s=300.0)
    out["transport"] = COMM.transport(COMM.group("t"))
    out["sum"] = collectives._all_reduce(torch.ones(4), "t").tolist()
    dist.barrier()
    if me == 1:  # dies between steps: outside any exchange, so it sets no error flag
        os._exit(0)
    time.sleep(0.2)
    COMM.set_action("step 2", timeout_s=300.0)
    start = time.monotonic()
    try:
        collectives._all_reduce(torch.ones(4), "t")
        out["dead"] = ""
    except AutopartError as exc:
        out["dead"] = str(exc)
    out["dead_seconds"] = time.monotonic() - start
    print(json.dumps(out), flush=True)
    os._exit(0)  # the process group has a dead member: no orderly teardown


if __name__ == "__main__":
    sys.exit(main())
