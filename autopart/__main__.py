"""``python -m autopart`` and the ``autopart`` command: a Ctrl-C while the CLI imports torch
ends it with status 130 and one line, not a traceback."""

import sys

from autopart.process import interrupts  # (light: no torch)


def run() -> int:
    seen = interrupts()
    try:
        from autopart.cli import main

        if interrupts() > seen:  # a Ctrl-C during the imports that C code dropped
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        print("autopart: interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
