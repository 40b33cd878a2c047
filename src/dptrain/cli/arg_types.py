"""argparse `type=` converters shared by the commands: a bad value is refused by argparse (exit 2,
the option and the value named), never passed on as NaN, zero or a negative count."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of nodes, workers, GPUs, steps)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a whole number >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not valid; give a whole number >= 1")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a whole number >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not valid; give a whole number >= 0")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (`nan`, `inf`, 0 and negatives refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a finite number > 0") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not valid; give a finite number > 0")
    return value
