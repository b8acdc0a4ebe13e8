"""Typed setting values from TOML values and command-line text, and the text of the
files users write them in.

`convert_value` turns what a user wrote into the type a setting is annotated with, or
a PartitaError that names the setting and shows a valid value; `read_user_file` reads
a user's TOML file (a run config, a planner model or hardware file) or says why not.
"""

from __future__ import annotations

import decimal
import types
import typing
from pathlib import Path

from partita.errors import PartitaError


def convert_value(dotted: str, raw: object, target: type) -> object:
    """Convert `raw` (TOML value or override string) to the annotated type."""
    optional = isinstance(target, types.UnionType) and type(None) in typing.get_args(target)
    if optional:
        target = next(t for t in typing.get_args(target) if t is not type(None))
        if isinstance(raw, str) and raw.lower() in ("none", "null", ""):
            return None
    try:
        if isinstance(raw, bool) and target is not bool:  # TOML `steps = true`: int(True) is 1
            raise ValueError(raw)
        if target is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if target is int:
            return _integer(raw)
        if target is float:
            return float(raw)
        if isinstance(raw, dict) and dotted in TABLE_SETTINGS:  # data.mix = {"a" = 0.7}
            return ", ".join(f"{k}={v}" for k, v in raw.items())
        if isinstance(raw, list | dict):  # str() would make a path of "['a', 'b']"
            raise ValueError(raw)
        return str(raw)
    except OverflowError:
        limit = f"within ±{INT_LIMIT:,} (64 bits)" if target is int else "a finite number"
        raise PartitaError(
            f"{dotted}={raw!r} is too large: {dotted} must be {limit}; give a smaller value."
        ) from None
    except (TypeError, ValueError, ArithmeticError):
        kind, example = TABLE_SETTINGS.get(dotted) or _KIND[target]
        what = _TOML_KIND.get(type(raw), "")
        raise PartitaError(
            f"{dotted}={raw!r} is {what + ', ' if what else ''}not {_KIND[target][0]}; give "
            f"{kind}, for example --{dotted}={example}."
        ) from None


def bare_flag(dotted: str, target: type) -> bool:
    """The value of `--dotted` written without one: true for a true-or-false setting;
    any other setting needs its value, and the PartitaError says so."""
    if target is bool or target == bool | None:
        return True
    base = next((t for t in typing.get_args(target) if t is not type(None)), target)
    raise PartitaError(
        f"--{dotted} is given without a value; give one, for example --{dotted}="
        f"{_KIND[base][1]} (only true-or-false settings may be given bare, meaning true)."
    )


def _integer(raw: object) -> int:
    """An integer from an int, an integral float, or text such as "300" or "1e3".

    Text with an exponent is read exactly (as a decimal) and taken only when integral,
    so "1.5e0" is refused like "1.5" rather than truncated to 1, and "1e400" is refused
    rather than overflowing.
    """
    if isinstance(raw, float):
        if not raw.is_integer():  # also NaN and infinity
            raise ValueError(raw)
        raw = int(raw)
    if isinstance(raw, str) and "e" in raw.lower():
        exact = decimal.Decimal(raw.strip().replace("_", ""))
        if not exact.is_finite() or exact != exact.to_integral_value():
            raise ValueError(raw)
        if exact.adjusted() > 18:  # past 64 bits; before building a 400-digit int
            raise OverflowError(raw)
        raw = int(exact)
    value = int(raw)  # type: ignore[call-overload]
    if abs(value) > INT_LIMIT:
        raise OverflowError(raw)
    return value


# Integer settings end up in 64-bit integers (torch seeds, numpy indices, counters).
INT_LIMIT = 2**63 - 1


_KIND = {bool: ("true or false", "true"), int: ("an integer", "4"),
         float: ("a number", "0.001"), str: ("text", "text")}
# A TOML list or table given for a setting, named in the message.
_TOML_KIND = {list: "a list", dict: "a table"}
# Text settings that also take a TOML table, joined into their text form "k=v, k=v"
# (docs/models_and_data.md, "Mixing"): what they take and an example, for the message.
TABLE_SETTINGS = {"data.mix": ("text or a TOML table",
                               '"a.jsonl=0.7, b.jsonl=0.3" (in TOML also mix = '
                               '{"a.jsonl" = 0.7, "b.jsonl" = 0.3})')}


def read_user_file(path: Path, what: str, give: str, missing: str = "check the path") -> str:
    """The UTF-8 text of the file `what` ('config file') at `path`, or a PartitaError:
    missing (then `missing`), a folder or not a regular file (then `give`), not UTF-8,
    or unreadable."""
    if path.is_dir():
        raise PartitaError(f"{what} '{path}' is a folder; {give}.")
    if not path.is_file():
        state = "does not exist" if not path.exists() else "is not a regular file"
        raise PartitaError(f"{what} '{path}' {state}; {missing}.")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PartitaError(f"{what} '{path}' is not UTF-8 text (byte {exc.start} is "
                           f"{exc.object[exc.start]:#04x}); TOML files are UTF-8: save it "
                           "as UTF-8.") from None
    except OSError as exc:  # permissions, a device, ...
        raise PartitaError(f"{what} '{path}' cannot be read: {exc.strerror or exc}.") from None

