"""`python -m ioattn ...`: the same command line as the `ioattn` console script."""

import sys

from ioattn.cli import main

sys.exit(main())
