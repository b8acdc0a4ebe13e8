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


class _Flatten(argparse.Action):
    """Joins the lists that `several`'s type returns for each word into one list."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: list[list[object]], option_string: str | None = None) -> None:
        setattr(namespace, self.dest, [value for word in values for value in word])


def several(item: Callable[[str], object], choices: tuple | None = None) -> dict:
    """`add_argument` keywords for an option that takes one or more values, each word
    itself comma-separated: `--worlds 2 4`, `--worlds 2,4` and `--worlds 2,4 8` all
    read [2, 4(, 8)], so every list option of the command line takes both spellings."""
    def parse(word: str) -> list[object]:
        values = []
        for part in word.split(","):
            value = item(part.strip())
            if choices is not None and value not in choices:
                raise argparse.ArgumentTypeError(
                    f"{part.strip()!r} is not one of {', '.join(map(str, choices))}")
            values.append(value)
        return values
    parse.__name__ = getattr(item, "__name__", "value")  # argparse names it in errors
    return dict(nargs="+", type=parse, action=_Flatten)
