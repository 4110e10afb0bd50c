"""`python -m renderfarm_cli ARGS`: the `renderfarm` command."""

import sys

from renderfarm_cli import main

sys.exit(main())
