"""What the multi-rank scripts (``loop_script.py``, ``accum_script.py``) ask of a habit that
must be refused."""

from collections.abc import Callable
from typing import Any

import autopart


def refused(fn: Callable[[], Any], words: str) -> bool:
    """Does ``fn()`` raise an ``AutopartError`` whose text holds ``words``?"""
    try:
        fn()
    except autopart.AutopartError as exc:
        return words in str(exc)
    return False
