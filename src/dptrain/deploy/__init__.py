"""Running dptrain where training runs: the notebook launcher (notebook.py)."""
