"""The one exception autopart raises for anything a user can fix."""

from __future__ import annotations


class AutopartError(Exception):
    """Bad input or an unsupported setting: says what is wrong and what to do.

    ``hint`` (optional) is printed on its own line after the message.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message, self.hint = message, hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")
