"""This process as autopart first saw it: its id and its parent's, recorded when ``autopart``
is first imported (its ``__init__`` imports this module first, before torch). A rank whose
launcher died while the rank was still importing has another parent by the time it calls
``runtime/launch.rank_setup``, which then stops it (the kernel's parent-death signal covers
only a parent that dies after the rank asked for it)."""

from __future__ import annotations

import os

STARTED = (os.getpid(), os.getppid())
