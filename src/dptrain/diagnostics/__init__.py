"""Diagnostics: hang watchdog, pre-flight checks, non-finite policy, stragglers, replica drift,
memory, and `dptrain doctor`. The trainer talks only to `Diagnostics` (hub.py)."""

from dptrain.diagnostics.hub import Diagnostics, apply_collective_checks

__all__ = ["Diagnostics", "apply_collective_checks"]
