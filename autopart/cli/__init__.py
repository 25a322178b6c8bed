"""The command line: ``autopart SUBCOMMAND``, one module per subcommand."""

from autopart.cli.app import main

__all__ = ["main"]
