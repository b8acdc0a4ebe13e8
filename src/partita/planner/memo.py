"""Memoisation of the planner's pure terms while a search runs.

A search judges up to ~10^6 layouts that differ from their neighbours in one or two
options, and most terms of a layout's memory and time read only a few of its fields:
the saved activations do not depend on the ZeRO stage or offload, the model states do
not depend on the microbatch size or schedule, a block's compute time on neither. Each
such term is declared with the fields it does not read,

    @memoised(ignores=("dp", "pp", "zero_stage", "offload", ...))
    def layer_activation_terms(model, layout, ...): ...

and inside `memoising()` (which `search` opens) it is computed once per distinct value
of everything else and reused: the same function of the same inputs, so every number
is bit for bit what a fresh call gives. Outside a search every call computes afresh,
so a single evaluation (`partita plan --layout`, the advice) keeps nothing.

A key is the function, the layout's fields less the ignored ones (a field added to
`Layout` later is in every key until a term is shown to ignore it), and the other
arguments: numbers and text by type and value, objects (the model, GPU, assumptions,
precision: all frozen) by identity, each held until the search ends so that no other
object can take its id. So a copy made afresh for each layout would never be found
again: what derives such objects is memoised too (`compiled_activations`).
tests/unit/test_planner_memo.py checks memoised and fresh results for equality.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import fields
from typing import Any, TypeVar

from partita.layout import Layout

F = TypeVar("F", bound=Callable[..., Any])

LAYOUT_FIELDS = tuple(f.name for f in fields(Layout))
_PLAIN = frozenset((int, float, str, bool, type(None)))


class _Memo:
    """The results of one search, and the objects their keys name by identity."""

    def __init__(self) -> None:
        # Per function, key -> result. Keys hold only numbers, text and tuples of them,
        # which the garbage collector stops tracking: a search keeps ~10^5 entries, and
        # a full collection walks every object it tracks.
        self.results: defaultdict[Callable, dict[tuple, Any]] = defaultdict(dict)
        self.held: list[object] = []  # kept alive, so that no other object takes an id
        self.by_id: dict[int, int] = {}  # id of a held object -> its token

    def token(self, obj: object) -> int:
        """A small number standing for `obj` in keys: its place among the objects held."""
        tok = self.by_id.get(id(obj))
        if tok is None:
            self.held.append(obj)
            tok = self.by_id[id(obj)] = len(self.held)  # from 1: a token is never false
        return tok

    def key(self, project: Callable[[Layout], tuple], args: tuple, kwargs: dict) -> tuple:
        """The key of a call with `args` and `kwargs`: layouts by their projection, numbers
        and text by type and value (1, 1.0 and True are equal but give different
        results), any other object by its token. (Called for every memoised call of a
        search: a plain loop, the fastest form.)"""
        key: list[object] = []
        by_id = self.by_id
        for value in (*args, *kwargs.values()) if kwargs else args:
            kind = type(value)
            if kind is Layout:
                key.append(project(value))
            elif kind in _PLAIN:
                key.append((kind, value))
            else:
                key.append(by_id.get(id(value)) or self.token(value))
        if kwargs:
            key.append(tuple(kwargs))  # which values were passed by which name
        return tuple(key)


_ACTIVE: ContextVar[_Memo | None] = ContextVar("partita_planner_memo", default=None)


@contextmanager
def memoising() -> Iterator[None]:
    """Within this block, memoised terms are computed once per distinct input (nested
    blocks start afresh; everything is released on leaving)."""
    token = _ACTIVE.set(_Memo())
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def memoised(ignores: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Memoise a pure function of a layout and other immutable arguments inside
    `memoising()`; `ignores` names the layout fields it does not read."""
    unknown = sorted(set(ignores) - set(LAYOUT_FIELDS))
    if unknown:
        raise ValueError(f"not fields of Layout: {', '.join(unknown)}")
    kept = [f for f in LAYOUT_FIELDS if f not in ignores]
    # A tuple whatever the count (attrgetter of one name gives the bare value).
    project = operator.attrgetter(*kept) if len(kept) > 1 else \
        (lambda layout: tuple(getattr(layout, f) for f in kept))

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def memoised_fn(*args, **kwargs):
            memo = _ACTIVE.get()
            if memo is None:
                return fn(*args, **kwargs)
            results = memo.results[memoised_fn]
            key = memo.key(project, args, kwargs)
            try:
                result = results[key]
            except KeyError:
                result = results[key] = fn(*args, **kwargs)
            kind = type(result)
            return _fresh(result) if kind is dict or kind is list else result

        # What tests check the memoised function against.
        memoised_fn.uncached = fn  # type: ignore[attr-defined]
        memoised_fn.ignores = tuple(ignores)  # type: ignore[attr-defined]
        return memoised_fn  # type: ignore[return-value]

    return wrap


def _fresh(result: Any) -> Any:
    """A result callers may change without changing the cached one: dicts (and the
    lists in them) and lists are copied; numbers, text, tuples and frozen dataclasses
    are immutable, handed out as they are (so nothing memoised returns a dict inside a
    tuple)."""
    kind = type(result)
    if kind is dict:
        return {k: (v.copy() if type(v) is list else v) for k, v in result.items()}
    if kind is list:
        return result.copy()
    return result
