"""Run by tests/test_shm.py on 2 ranks, rank 1 in a PID namespace of its own (``unshare
--pid``), both on this host's /dev/shm: containers that share IPC but not PIDs. (1) A wait of
1 s on a live peer whose process id means nothing here must not call it dead. (2) A peer that
dies between steps is still named, by its stopped heartbeat. Prints one JSON line on rank 1."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from autopart import collectives
from autopart.errors import AutopartError
from autopart.runtime import shm
from autopart.runtime.comm import Comm

COMM = Comm()  # this script's runtime context (a Runner owns one)
collectives.activate(COMM)


def main() -> int:
    shm.STALE_S = 2.0  # the heartbeat's verdict sooner than the default 10 s
    dist.init_process_group("gloo")
    me = dist.get_rank()
    out = {"namespace": shm.pid_namespace()}
    COMM.bind("t", dist.new_group([0, 1]))
    COMM.set_action("step 1", timeout_s=120.0)
    out["transport"] = COMM.transport(COMM.group("t"))
    out["sum"] = collectives._all_reduce(torch.ones(4), "t").tolist()
    if me == 0:
        time.sleep(1.0)  # rank 1 waits a second on a live rank 0 in another namespace
    COMM.set_action("step 2")
    out["sum2"] = collectives._all_reduce(torch.ones(4), "t").tolist()
    dist.barrier()
    if me == 0:  # dies between steps: outside any exchange, so it sets no error flag
        os._exit(0)
    COMM.set_action("step 3")
    start = time.monotonic()
    try:
        collectives._all_reduce(torch.ones(4), "t")
        out["dead"] = "not noticed"
    except AutopartError as exc:
        out["dead"] = str(exc)
    out["dead_seconds"] = time.monotonic() - start
    print(json.dumps(out), flush=True)
    collectives.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
