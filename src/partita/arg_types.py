"""argparse types for the command line's numeric options.

A count of zero or a negative size would otherwise reach the code it sizes and fail
there with a traceback (an empty median, an index out of range) or, worse, run and
print nothing useful. These refuse it while the arguments are parsed, naming the
option, before anything is built or launched. (Options with an upper bound as well,
such as `partita plan --gpus`, are checked after parsing by `errors.require_in_range`,
in the same words.)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def at_least(minimum: int | float, kind: type = int,
             maximum: int | float | None = None) -> Callable[[str], int | float]:
    """A type for a number of `kind` (int or float) that is `minimum` or more (and
    `maximum` or less, when given)."""
    def parse(text: str) -> int | float:
        what = "a whole number" if kind is int else "a finite number"
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value):  # float("nan") compares false with any minimum
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        if value < minimum or (maximum is not None and value > maximum):
            use = (f"{minimum} or more" if maximum is None
                   else f"{minimum} to {maximum:,}")
            raise argparse.ArgumentTypeError(f"{text} is out of range: use {use}")
        return value
    return parse


count = at_least(1)  # a number of things (ranks, rounds, layers, tokens): 1 or more


def counts(text: str) -> list[int]:
    """A comma-separated list of counts, such as world sizes: `1,2,4`."""
    return [count(part.strip()) for part in text.split(",")]
