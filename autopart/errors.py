"""The one exception autopart raises for anything a user can fix."""

from __future__ import annotations

from typing import Any


class AutopartError(Exception):
    """Bad input or an unsupported setting: says what is wrong and what to do.

    ``hint`` (optional) is printed on its own line after the message.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message, self.hint = message, hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


PEER_HINT = "a peer rank probably died or is stuck; check its log"


def wait(work: Any, rank: Any, what: str, timeout_s: float, hint: str = PEER_HINT) -> None:
    """Wait for a c10d ``work`` handle at most ``timeout_s``; a failure or a timeout becomes an
    ``AutopartError`` naming the rank and what it waited for (every distributed wait of the
    runtime, the collectives and the checkpoints goes through here)."""
    from datetime import timedelta

    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - any backend failure becomes a named one
        raise AutopartError(
            f"rank {rank}: {what} failed or timed out after {timeout_s:.0f} s: {exc}", hint=hint
        ) from exc
    if ok is False:
        raise AutopartError(f"rank {rank}: timed out after {timeout_s:.0f} s in {what}", hint=hint)
