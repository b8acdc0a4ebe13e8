"""Functions that compiled code calls rather than traces.

Collectives (gloo and NCCL calls dynamo cannot trace) and code whose tensor shapes
depend on the data (an MoE layer's tokens per expert) run eagerly between the compiled
pieces of a block: each `EagerOnly` function is one deliberate graph break.

    @EagerOnly
    def all_reduce_into(x, comm): ...

    keep_out_of_compiled_graphs()   # partita.compile, before anything compiles

A `trace_time_constant` function is the other kind compiled code calls rather than
traces: dynamo calls it once while tracing and bakes its result into the graph as a
constant (`torch.compiler.assume_constant_result`). Its arguments must be plain Python
values, which dynamo guards on, so a call with other arguments traces again instead of
reusing a stale constant. The rotary tables are one: traced, their float64 cos and sin
were fused into every kernel that reads them and recomputed per element.

The functions become `torch.compiler.disable`d (or constant) only then: importing dynamo
to mark them at import time would cost every eager process about a second of start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class EagerOnly:
    """A function compiled code must call, not trace (see the module docstring)."""

    instances: list[EagerOnly] = []  # every one, for keep_out_of_compiled_graphs

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__
        EagerOnly.instances.append(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


_TRACE_TIME_CONSTANTS: list[Callable] = []


def trace_time_constant(fn: Callable) -> Callable:
    """Register `fn` (plain-value arguments, no side effects) as a trace-time constant."""
    _TRACE_TIME_CONSTANTS.append(fn)
    return fn


def keep_out_of_compiled_graphs() -> None:
    """Mark every `EagerOnly` function `torch.compiler.disable` and every trace-time
    constant `torch.compiler.assume_constant_result` (once)."""
    for wrapped in EagerOnly.instances:
        if not getattr(wrapped.fn, "_torchdynamo_disable", False):
            wrapped.fn = torch.compiler.disable(wrapped.fn)
    # The call itself too: otherwise, after the graph break at a call, dynamo compiles
    # `__call__`'s own frame, one guarded entry per distinct signature, until its
    # recompile limit warns (an MoE block calls several).
    if not getattr(EagerOnly.__call__, "_torchdynamo_disable", False):
        EagerOnly.__call__ = torch.compiler.disable(EagerOnly.__call__)
    for fn in _TRACE_TIME_CONSTANTS:
        torch.compiler.assume_constant_result(fn)  # marks fn itself
