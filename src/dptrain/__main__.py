"""`python -m dptrain` is the `dptrain` command."""

import sys

from dptrain.cli.main import main

sys.exit(main())
