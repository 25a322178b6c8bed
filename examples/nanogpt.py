"""The nanoGPT-style GPT of autopart's tests and demo, as a model SPEC
(``examples/nanogpt.py:make``). The model itself lives in ``autopart/models/nanogpt.py`` so that
``autopart demo`` runs from a plain install; its factories are re-exported here."""

from autopart.models.nanogpt import *  # noqa: F403
from autopart.models.nanogpt import __all__  # noqa: F401
