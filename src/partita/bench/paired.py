"""Paired rounds: one step-time ratio, how sure it is, and when to stop adding rounds.

A benchmark pair runs ours and a peer in alternating rounds (A B, B A, ...), each round
giving one ratio. The estimate is the median of those ratios, and its confidence
interval comes from order statistics: no assumption about their distribution, which on
a shared machine has long tails (a pair of identical runners read single rounds from
0.77 to 1.48 on this project's 2-core machine, and medians of 20 rounds 0.964-1.049).

With a threshold (1.0 for ours against a peer), a pair runs more rounds, doubling, until
the interval lies wholly on one side of it or the cap is reached: rounds go where the
verdict is close, not to pairs that are clearly apart. Looking at the data up to four
times raises the chance of settling on the wrong side, so the interval is the 99% one,
which keeps that chance at a few percent over all looks.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

Z_99 = 2.576  # two-sided 99% quantile of the normal distribution


@dataclass(frozen=True)
class Estimate:
    median: float
    low: float  # 99% confidence interval of the median
    high: float
    rounds: int

    def settled(self, threshold: float) -> bool:
        """The interval lies wholly on one side of `threshold`."""
        return self.high <= threshold or self.low > threshold

    @property
    def span(self) -> str:
        return f"{self.low:.3f}-{self.high:.3f}"


def estimate(ratios: Sequence[float]) -> Estimate:
    """Median of `ratios` with its distribution-free 99% interval: the order statistics
    n/2 -/+ z*sqrt(n)/2 (normal approximation of the binomial; 1-based ranks)."""
    xs = sorted(ratios)
    n = len(xs)
    half = Z_99 * math.sqrt(n) / 2
    lo = max(1, round(n / 2 - half))
    hi = min(n, round(1 + n / 2 + half))
    return Estimate(statistics.median(xs), xs[lo - 1], xs[hi - 1], n)


def ratios(times: tuple[list[float], list[float]]) -> list[float]:
    return [a / b for a, b in zip(*times)]


def estimate_times(times: tuple[list[float], list[float]]) -> Estimate:
    """The estimate of side 0 / side 1 from `paired_rounds`' times."""
    return estimate(ratios(times))


def slowest_rank(seconds: float, device: torch.device | None = None) -> float:
    """The largest of every rank's `seconds` (a collective over the default group):
    a round's time as `paired_rounds` needs it, the same on every rank."""
    took = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def paired_rounds(time_side: Callable[[int], float], rounds: int, max_rounds: int,
                  threshold: float | None) -> tuple[list[float], list[float]]:
    """Seconds of side 0 and side 1 over alternating rounds: `rounds` of them, then,
    with a threshold, doubled until the ratio's interval settles or `max_rounds` (a cap
    below `rounds` means no doubling).

    `time_side(k)` runs and times side k once; every rank must get the same value back
    (the callers reduce each time over the ranks), so that all take the same decisions
    and issue the same collectives."""
    times: tuple[list[float], list[float]] = ([], [])
    target = rounds
    while True:
        while len(times[0]) < target:
            first = len(times[0]) % 2  # which side goes first alternates
            for k in (first, 1 - first):
                times[k].append(time_side(k))
        if threshold is None or target >= max_rounds or \
                estimate_times(times).settled(threshold):
            return times
        target = min(2 * target, max_rounds)


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages, printed beside a benchmark's
    figures: on a shared machine they say how much else was running."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"
