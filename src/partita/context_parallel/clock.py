"""Seconds a rank spends computing attention pieces, apart from waiting for transfers.

Load-balanced sharding gives every rank the same number of pieces; `bench cp` checks
that the time agrees: each rank's `AttentionClock` adds up the compute sections of its
ring (or all-gather) attention, forward and backward, and never the waits on the
transfers, which couple the ranks and would hide an imbalance.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class AttentionClock:
    """Wall seconds and CPU seconds of the calling thread (what a rank with one intra-op
    thread computes, whatever else runs on its core) inside `compute()` sections."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    @contextmanager
    def compute(self):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu

    def reset(self) -> None:
        self.seconds = self.cpu_seconds = 0.0


class _Idle:
    """The clock of attention that nobody times: no cost beyond a call."""

    @contextmanager
    def compute(self):
        yield


IDLE = _Idle()
