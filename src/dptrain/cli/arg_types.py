"""argparse `type=` converters shared by the commands: a bad value is refused by argparse (exit 2,
the option and the value named), never passed on as NaN, zero or a negative count."""

from __future__ import annotations

import argparse
import math


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a whole number >= {low}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is not valid; give a whole number >= {low}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of nodes, workers, GPUs, steps)."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (`nan`, `inf`, 0 and negatives refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a finite number > 0") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not valid; give a finite number > 0")
    return value
