"""`python -m tiercache`: the same command line as `tiercache`."""

import sys

from tiercache.cli import main

sys.exit(main())
