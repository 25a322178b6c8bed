"""``python -m autopart`` and the ``autopart`` command: a Ctrl-C while the CLI imports torch
and its commands' modules ends it at once with status 130 and one line, not a traceback (once
a command runs, ``cli.main`` says "interrupted" itself).

While the imports run, a SIGINT exits the process on the spot (``os._exit``): nothing has been
launched or written yet, and a ``KeyboardInterrupt`` raised there can land inside a callback
torch's C++ import code runs, which cannot pass it on and aborts the process instead
(``terminate called after throwing ... pybind11::error_already_set``, status -6: seen in CI).
"""

import os
import signal
import sys
from typing import Any

from autopart.process import counting  # (light: no torch)


def _stop_now(signum: int, frame: Any) -> None:
    os.write(2, b"autopart: interrupted\n")
    os._exit(130)


def run() -> int:
    try:  # only where a Ctrl-C would interrupt anyway (not under nohup's ignore)
        before = signal.getsignal(signal.SIGINT)
        if before is signal.default_int_handler or before is counting:
            signal.signal(signal.SIGINT, _stop_now)
    except ValueError:  # not the main thread: no handler can be set there
        before = None
    try:
        from autopart.cli import build_parser, main

        build_parser()  # imports each command's module too (their options name its defaults)
    finally:
        if before is not None and signal.getsignal(signal.SIGINT) is _stop_now:
            signal.signal(signal.SIGINT, before)
    return main()


if __name__ == "__main__":
    sys.exit(run())
