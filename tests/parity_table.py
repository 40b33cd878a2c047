"""Prints the parity ladder as a table: `python tests/parity_table.py` (the code: tests/support/parity_table.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.parity_table import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
