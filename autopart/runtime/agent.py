"""The torchrun agent ``launch`` starts: ``python -m autopart.runtime.agent TORCHRUN-ARGS``.

It is ``torch.distributed.run``, with its two endings that are not failures of its own said in
one line instead of a traceback of torchrun's frames: a SIGINT / SIGTERM the launcher forwarded
(torchrun's ``SignalException``: the agent stops its ranks, then exits with 128 + the signal,
silently: the launcher says what happened), and ranks that failed (``ChildFailedError``: the
first failed rank, its process and its exit code or signal, exit status 1 as torchrun's). The
ranks' own output, their error lines with it, is theirs and passes unchanged.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def failure_line(exc: ChildFailedError) -> str:
    """One line for ranks that failed: the first one, how it ended, and how many failed."""
    rank, first = exc.get_first_failure()
    how = (
        f"was killed by {first.signal_name()}"
        if first.exitcode < 0
        else f"exited with status {first.exitcode}"
    )
    more = len(exc.failures) - 1
    also = f" ({more} more rank{'s' if more > 1 else ''} failed)" if more else ""
    return f"torchrun: rank {rank} (process {first.pid}) {how}{also}"


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun(argv)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        print(failure_line(exc), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
