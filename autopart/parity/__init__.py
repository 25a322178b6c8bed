"""Parity: loss and every gradient of a compiled program against one device. ``verify``
compiles, launches real ranks and compares (``Report``); ``checks`` is the rank side
(``torchrun -m autopart.parity.checks``)."""
