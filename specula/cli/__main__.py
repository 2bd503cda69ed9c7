"""``python -m specula.cli``: the ``specula`` command without its console script."""

import sys

from specula.cli import main

sys.exit(main())
