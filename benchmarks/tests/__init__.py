"""The laboratory's tests, a package: their conftest and modules are not the top-level
``conftest`` and ``test_*`` of tests/ (both folders are in the default run)."""
