"""Run reports: `dptrain report RUN_DIR` reads what a run wrote (read.py), draws the figures
(plots.py, matplotlib: the optional extra `dptrain[report]`) and writes one HTML page (page.py)."""

from dptrain.tools.report.page import build_report
from dptrain.tools.report.plots import MissingExtra

__all__ = ["MissingExtra", "build_report"]
