import sys

from autopart.cli import main

sys.exit(main())
