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

Below 8 rounds no two order statistics reach 99%: the interval is then the range of the
rounds, which holds the median with probability 1 - 2^(1-n) only (n = 1: none; 2: 50%;
6: 97%; 7: 98%). `Estimate.label` names it for what it is, and such an interval never
settles a verdict: a pair with fewer rounds doubles them (up to its cap) first. A table
heads its column "interval", and `legend` says under it what the rows below 8 rounds hold.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

Z_99 = 2.576  # two-sided 99% quantile of the normal distribution
LEVEL = 0.99  # the coverage an interval needs to be called, and to settle, as the 99% one


def ranks(n: int) -> tuple[int, int]:
    """1-based ranks of the order statistics that bound the median's interval among `n`:
    n/2 -/+ z*sqrt(n)/2 (normal approximation of the binomial), within 1..n."""
    half = Z_99 * math.sqrt(n) / 2
    return max(1, round(n / 2 - half)), min(n, round(1 + n / 2 + half))


def coverage(n: int) -> float:
    """The exact probability that the interval `ranks(n)` holds the median of the
    distribution the `n` values came from (any continuous one): that between lo and
    hi - 1 of them lie below it, a binomial(n, 1/2) count."""
    lo, hi = ranks(n)
    return sum(math.comb(n, k) for k in range(lo, hi)) / 2 ** n


@dataclass(frozen=True)
class Estimate:
    median: float
    low: float  # confidence interval of the median: the 99% one from 8 rounds on,
    high: float  # the range of the rounds below (see `coverage`)
    rounds: int

    @property
    def coverage(self) -> float:
        """The probability that [low, high] holds the median (`coverage`)."""
        return coverage(self.rounds)

    def settled(self, threshold: float) -> bool:
        """The interval is a 99% one (8 rounds or more) and lies wholly on one side of
        `threshold`."""
        return self.coverage >= LEVEL and (self.high <= threshold or self.low > threshold)

    @property
    def span(self) -> str:
        return f"{self.low:.3f}-{self.high:.3f}"

    @property
    def label(self) -> str:
        """What `span` is: "99% interval", or, below 8 rounds, the range it is and how
        often such a range holds the median ("range of 6 rounds, 97% for the median";
        one round has no interval)."""
        if self.coverage >= LEVEL:
            return "99% interval"
        if self.rounds == 1:
            return "1 round, no interval"
        return f"range of {self.rounds} rounds, {self.coverage:.0%} for the median"

    @property
    def described(self) -> str:
        """The interval with its rounds, for a parenthesis after the median:
        "0.815-1.127, 24 rounds" for a 99% interval, else "0.815-1.127: range of 6
        rounds, 97% for the median" or "1 round, no interval"."""
        if self.coverage >= LEVEL:
            return f"{self.span}, {self.rounds} rounds"
        if self.rounds == 1:
            return self.label
        return f"{self.span}: {self.label}"

    @property
    def stated(self) -> str:
        """`described`, led by "99% interval" where it is one: "99% interval
        0.815-1.127, 24 rounds", else "0.815-1.127: range of 6 rounds, 97% for the
        median" or "1 round, no interval"."""
        if self.coverage >= LEVEL:
            return f"{self.label} {self.described}"
        return self.described


# The fewest rounds whose interval is a 99% one (8); from there on every count's is.
FULL_ROUNDS = next(n for n in itertools.count(1) if coverage(n) >= LEVEL)


def legend(estimates: Iterable[Estimate]) -> str | None:
    """The line under a table whose "interval" column holds some intervals that are not
    99% ones (fewer than `FULL_ROUNDS` rounds): what those are, one `Estimate.label` per
    number of rounds, fewest first. None where every interval is a 99% one."""
    short = {e.rounds: e for e in estimates if e.coverage < LEVEL}
    if not short:
        return None
    return (f"interval: 99% for the median from {FULL_ROUNDS} rounds on; below that: "
            + "; ".join(short[n].label for n in sorted(short)))


def print_legend(estimates: Iterable[Estimate]) -> None:
    """Prints `legend`, where there is one."""
    line = legend(estimates)
    if line is not None:
        print(line, flush=True)


def estimate(ratios: Sequence[float]) -> Estimate:
    """Median of `ratios` with its distribution-free interval: the order statistics of
    `ranks` (99% from 8 rounds on; below, the range of the rounds, `Estimate.label`)."""
    xs = sorted(ratios)
    lo, hi = ranks(len(xs))
    return Estimate(statistics.median(xs), xs[lo - 1], xs[hi - 1], len(xs))


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
