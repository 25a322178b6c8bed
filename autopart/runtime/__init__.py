"""Runtime: one ``Runner`` per rank executes a saved or in-memory ``RankProgram`` (``runner``,
with ``p2p`` sends and ``shm`` shared-memory collectives), launched by ``run``
(``python -m autopart.runtime.run DIR``); ``checkpoint`` saves and reloads any layout;
``timeline`` draws its traces."""
