"""Prints the tensor-parallel parity ladder as a table: `python tests/tp_parity_table.py` (the code:
tests/support/tp_parity_table.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.tp_parity_table import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
