"""The program format: ``Program`` / ``RankProgram`` (what each rank runs), their files
(``Program.save``, ``load_rank``: ``format``) and the safe-loading check of graph archives
(``archive``). Nothing here runs a model."""
