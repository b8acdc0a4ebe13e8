"""User-facing errors.

Every mistake a user can make (a bad layout, a missing file, a mismatched checkpoint)
raises `PartitaError` with one paragraph that says what is wrong and how to fix it.
The CLI prints that paragraph without a traceback; anything else is a bug in partita.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PartitaError(Exception):
    """An error caused by input the user can change; the message says how."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to `name`, or None when nothing is close."""
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return found[0] if found else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """' Did you mean X?' when a close candidate exists, else ''."""
    best = closest(name, candidates)
    return f" Did you mean '{best}'?" if best else ""


class AgreedError(PartitaError):
    """A PartitaError that every rank raises identically (it follows from values all ranks
    share, such as the all-reduced loss); only rank 0 needs to print it."""
