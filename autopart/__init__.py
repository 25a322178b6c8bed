"""autopart: compile an unmodified GPT into one parallel program per rank."""

from autopart.capture import Captured, capture
from autopart.errors import AutopartError

__all__ = ["AutopartError", "Captured", "capture"]
