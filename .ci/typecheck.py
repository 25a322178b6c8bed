"""Type-check autopart and its passes with mypy, under the module names they are installed as.

setup.py installs the top-level ``passes/`` folder as ``autopart.passes``; mypy derives module
names from file paths and would check ``passes/x.py`` as ``passes.x``, leaving every
``import autopart.passes.x`` unresolved. This script runs mypy exactly as the command line
would (same options, from pyproject.toml's ``[tool.mypy]``, plus any arguments given here),
after renaming the passes' sources to ``autopart.passes.*``. Exit status as mypy's: 0 clean,
1 type errors, 2 a blocking error.

Usage: python .ci/typecheck.py [mypy options] [files]
"""

from __future__ import annotations

import sys
import time

from mypy import util
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build, show_messages
from mypy.modulefinder import BuildSource

FOLDER, PACKAGE = "passes", "autopart.passes"


def installed_name(source: BuildSource) -> BuildSource:
    """The source under its installed module name: passes.x -> autopart.passes.x."""
    module = source.module
    if module != FOLDER and not module.startswith(FOLDER + "."):
        return source
    return BuildSource(
        source.path, PACKAGE + module[len(FOLDER) :], source.text, source.base_dir, source.followed
    )


def main(argv: list[str]) -> int:
    t0 = time.time()
    fscache = FileSystemCache()
    sources, options = process_options(argv, stdout=sys.stdout, stderr=sys.stderr, fscache=fscache)
    sources = [installed_name(s) for s in sources]
    _, messages, blockers = run_build(sources, options, fscache, t0, sys.stdout, sys.stderr)
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    if options.non_interactive:
        show_messages(messages, sys.stderr, formatter, options)
    n_errors, n_notes, n_files = util.count_stats(messages)
    if n_errors:
        print(formatter.format_error(n_errors, n_files, len(sources), blockers=blockers))
    elif not messages or n_notes == len(messages):
        print(formatter.format_success(len(sources)))
    if messages and n_notes < len(messages):
        return 2 if blockers else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
