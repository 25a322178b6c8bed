"""``autopart run`` with a crash, for tests/test_checkpoint.py (run under torchrun with
restarts): rank 1 SIGKILLs itself as step ``KILL_AT_STEP`` starts, on the job's first attempt
only (``TORCHELASTIC_RESTART_COUNT=0``), as a crash would. Arguments: those of autopart run."""

import os
import signal
import sys

from autopart.runtime import run
from autopart.runtime.runner import Runner

AT = int(os.environ["KILL_AT_STEP"])
FIRST = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
_step = Runner.step


def step(self, *args, **kwargs):
    if FIRST and self.rank == 1 and self.steps == AT:
        print(f"rank 1: killing myself (SIGKILL) at step {AT}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return _step(self, *args, **kwargs)


Runner.step = step
sys.exit(run.main(sys.argv[1:]))
