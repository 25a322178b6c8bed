"""Run on 2 forked ranks by tests/test_shm.py: a peer that is paused (SIGSTOP), not dead, on
the shared-memory transport, with the heartbeat's verdict due after 0.5 s instead of 10 s.
(1) Rank 0 stops rank 1 for 2 s, then continues it, while it waits in an all-reduce with a
30 s timeout: the all-reduce completes (a paused rank used to be reported dead once its
heartbeat stood for ``STALE_S``). (2) Rank 0 stops rank 1 and waits with a 2 s timeout: the
timeout names rank 1 as silent, paused or hung, not dead. Prints one JSON line on rank 0."""

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from autopart import collectives
from autopart.errors import AutopartError
from autopart.runtime import shm
from autopart.runtime.comm import Comm

COMM = Comm()  # this script's runtime context (a Runner owns one)
collectives.activate(COMM)


def paused(pid: int, seconds: float) -> None:
    """Stop ``pid`` now; continue it ``seconds`` later (from a thread)."""
    os.kill(pid, signal.SIGSTOP)
    threading.Timer(seconds, os.kill, (pid, signal.SIGCONT)).start()


def main() -> int:
    dist.init_process_group("gloo")
    me = dist.get_rank()
    shm.STALE_S = 0.5  # the heartbeat's verdict: a stopped process's beat stands still
    pids: list[int] = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    COMM.bind("t", dist.new_group([0, 1]))
    COMM.set_action("setup", timeout_s=60.0)
    out: dict = {"transport": COMM.transport(COMM.group("t"))}
    collectives._all_reduce(torch.ones(4), "t")

    dist.barrier()
    COMM.set_action("step 1", timeout_s=30.0)
    if me == 0:
        paused(pids[1], 2.0)
    else:
        time.sleep(0.5)  # stopped here, before its all-reduce
    start = time.monotonic()
    try:
        out["sum"] = collectives._all_reduce(torch.ones(4), "t").tolist()
    except AutopartError as exc:
        out["sum"] = str(exc)
    out["paused_seconds"] = time.monotonic() - start

    dist.barrier()
    COMM.set_action("step 2", timeout_s=2.0 if me == 0 else 30.0)
    if me == 0:
        os.kill(pids[1], signal.SIGSTOP)
    else:
        time.sleep(0.5)  # stopped here, before its all-reduce
    start = time.monotonic()
    try:
        collectives._all_reduce(torch.ones(4), "t")
        out["silent"] = ""
    except AutopartError as exc:
        out["silent"] = str(exc)
    out["silent_seconds"] = time.monotonic() - start
    if me == 0:
        os.kill(pids[1], signal.SIGCONT)  # it then finds this rank's failure and stops
        out["pid"] = pids[1]
        print(json.dumps(out), flush=True)
    os._exit(0)  # the group failed: no orderly teardown


if __name__ == "__main__":
    sys.exit(main())
