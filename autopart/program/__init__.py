"""The program format: ``Program`` / ``RankProgram`` (what each rank runs), their files
(``Program.save``, ``load_rank``: ``format``), and the loader's checks of a folder it does not
trust (docs/security.md): ``folder`` (files by autopart's names only, never through a link),
``schema`` and ``plan_json`` (plan.json and program.json), ``archive`` (zip layout, stage
archives, weights), ``graph_json`` (a stage archive's model.json) and ``symexpr`` (the grammar
of symbolic sizes). Nothing here runs a model."""
