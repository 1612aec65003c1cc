"""``python -m edgeflow``: the same command line as ``edgeflow``."""

import sys

from edgeflow.cli.main import main

sys.exit(main())
