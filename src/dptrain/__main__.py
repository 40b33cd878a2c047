"""`python -m dptrain` is the `dptrain` command."""

import sys

from dptrain.cli import main

sys.exit(main())
