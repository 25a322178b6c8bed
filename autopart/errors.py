"""The one exception autopart raises for anything a user can fix, and the command lines'
argument types that refuse a count or a duration no run can take (``positive_int``,
``positive_seconds``), before anything is compiled or launched."""

from __future__ import annotations

import argparse
import math
from typing import Any


class AutopartError(Exception):
    """Bad input or an unsupported setting: says what is wrong and what to do.

    ``hint`` (optional) is printed on its own line after the message.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message, self.hint = message, hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


class NotAModuleError(AutopartError, AttributeError):
    """An ``nn.Module`` attribute asked of an object that only stands in for the model (the
    live ``Runner``): an ``AttributeError`` still, so ``hasattr`` answers False and torch's
    duck typing goes on, but the message says what to use instead."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for an
    error that quotes torch's."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


PEER_HINT = "a peer rank failed earlier (its own error is in its output), died, or is stuck"


def wait(work: Any, rank: Any, what: str, timeout_s: float, hint: str = PEER_HINT) -> None:
    """Wait for a c10d ``work`` handle at most ``timeout_s``; a failure or a timeout becomes an
    ``AutopartError`` naming the rank and what it waited for (every distributed wait of the
    runtime, the collectives and the checkpoints goes through here)."""
    import time
    from datetime import timedelta

    start = time.monotonic()
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - any backend failure becomes a named one
        took = time.monotonic() - start
        how = (
            f"timed out after {timeout_s:.0f} s"
            if took >= 0.95 * timeout_s
            else f"failed after {took:.1f} s"  # a peer that died or closed its connection
        )
        raise AutopartError(f"rank {rank}: {what} {how}: {exc}", hint=hint) from exc
    if ok is False:
        raise AutopartError(f"rank {rank}: timed out after {timeout_s:.0f} s in {what}", hint=hint)


def positive_int(text: str) -> int:
    """argparse's type for a count (``--seq-len``, ``--steps``): a whole number ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


def positive_seconds(text: str) -> float:
    """argparse's type for a timeout: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, not {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value
