"""Probes that record something at every training step of a parity run.

A probe (`partita.testing.Probe`) runs once on each rank after the parallel model is
built; its result is the rank's record under "probe". `record_steps` turns a function
of the model's state into such a record, one entry per step, on the layouts and on the
one-process reference alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from partita.parallelize import ParallelModel


class _StepRecorder:
    """`pm.runner`, plus a record taken around each training step (`record_steps`)."""

    def __init__(self, runner: Any, after: Callable[[Any], Any],
                 before: Callable[[], Any] | None, log: list) -> None:
        self.inner, self.after, self.before, self.log = runner, after, before, log

    def train(self, *args: Any, **kwargs: Any) -> float:
        start = self.before() if self.before is not None else None
        loss = self.inner.train(*args, **kwargs)
        self.log.append(self.after(start))
        return loss

    def __getattr__(self, name: str) -> Any:  # evaluate and the rest: unrecorded
        return getattr(self.inner, name)


def record_steps(pm: ParallelModel, after: Callable[[Any], Any],
                 before: Callable[[], Any] | None = None) -> list:
    """A probe's per-step record: wraps `pm.runner` so that each training step (one
    `train` call, all its microbatches) appends `after(before())` to the list returned,
    `before()` taken just before the step (None without `before`). Evaluation passes
    through unrecorded; `partita.testing.reference` takes the same probe."""
    log: list = []
    pm.runner = _StepRecorder(pm.runner, after, before, log)
    return log
