"""This process as autopart first saw it, recorded when ``autopart`` is first imported (its
``__init__`` imports this module first, before torch):

- ``STARTED``: its id and its parent's. A rank whose launcher died while the rank was still
  importing has another parent by the time it calls ``runtime/launch.rank_setup``, which then
  stops it (the kernel's parent-death signal covers only a parent that dies after the rank
  asked for it).
- ``interrupts()``: how many SIGINTs it has had since. Python turns a SIGINT into a
  ``KeyboardInterrupt`` wherever the main thread is, and C code that clears errors (an import's
  ``hasattr``) can drop it: a Ctrl-C while ``autopart run`` imported torch was seen to be lost,
  and the launch went on to train every step. The count is kept by a handler that then raises
  ``KeyboardInterrupt`` as Python's own does, installed only where Python's own is;
  ``launch`` reads it around its own start-up (the CLI's imports stop at once instead, see
  ``autopart/__main__``). This is the one process-wide record autopart keeps, as a signal is
  process-wide.
"""

from __future__ import annotations

import os
import signal
from typing import Any

STARTED = (os.getpid(), os.getppid())
_SIGINTS: list[int] = []  # one entry per SIGINT this process received


def counting(signum: int, frame: Any) -> None:
    """The SIGINT handler autopart installs: count it, then raise ``KeyboardInterrupt``."""
    _SIGINTS.append(signum)
    signal.default_int_handler(signum, frame)


def interrupts() -> int:
    """The SIGINTs this process has received since autopart was first imported."""
    return len(_SIGINTS)


try:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, counting)
except ValueError:  # imported first outside the main thread: no handler can be set there
    pass
