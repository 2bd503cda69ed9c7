"""``python -m research``: the research command line (research/cli.py)."""

import sys

from research.cli import main

sys.exit(main())
