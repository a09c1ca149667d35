"""`python -m testbed.cli`: the `multispin` command."""

import sys

from testbed.cli import main

sys.exit(main())
