"""What a paired benchmark's interval is worth below 8 rounds: the range of the rounds,
named with the probability that it holds the median, and never enough to settle a
verdict (partita.bench.paired)."""

import itertools
from fractions import Fraction

import pytest

from partita.bench.paired import coverage, estimate, paired_rounds


def enumerated_coverage(n: int) -> Fraction:
    """Over all 2^n equally likely ways for n values to fall below or above the median
    (0 here), the share whose interval holds 0: counted, not derived."""
    held = 0
    for below in itertools.product((True, False), repeat=n):
        xs = [-(i + 1) if b else i + 1 for i, b in enumerate(below)]
        est = estimate([float(x) for x in xs])
        held += est.low <= 0 <= est.high
    return Fraction(held, 2 ** n)


@pytest.mark.parametrize("n", [1, 2, 3, 6, 7, 8, 9, 12])
def test_coverage_is_the_share_of_samples_whose_interval_holds_the_median(n):
    assert coverage(n) == pytest.approx(float(enumerated_coverage(n)), abs=1e-12)


def test_small_intervals_are_the_range_and_say_so():
    one = estimate([1.022])
    assert (one.low, one.high, one.coverage) == (1.022, 1.022, 0.0)
    assert one.label == "1 round, no interval"
    assert one.described == "1 round, no interval"

    six = estimate([0.9, 1.1, 1.0, 0.95, 1.05, 1.2])
    assert (six.low, six.high) == (0.9, 1.2)  # the range
    assert six.coverage == 31 / 32
    assert six.label == "range of 6 rounds, 97% for the median"
    assert six.described == "0.900-1.200: range of 6 rounds, 97% for the median"

    assert estimate([1.0, 2.0]).label == "range of 2 rounds, 50% for the median"
    assert estimate([float(x) for x in range(7)]).label == \
        "range of 7 rounds, 98% for the median"


def test_from_eight_rounds_the_interval_is_a_99_percent_one():
    for n in (8, 9, 16, 20, 24, 160):
        est = estimate([float(x) for x in range(n)])
        assert est.coverage >= 0.99, n
        assert est.label == "99% interval"
        assert est.described == f"{est.span}, {n} rounds"


def test_a_range_below_99_percent_settles_nothing():
    assert not estimate([0.9] * 6).settled(1.0)  # all six below: still open
    assert not estimate([1.1] * 7).settled(1.0)
    assert estimate([0.9] * 8).settled(1.0)
    assert estimate([1.1] * 8).settled(1.0)


def test_a_pair_started_below_eight_rounds_doubles_before_it_settles():
    def time_side(k: int) -> float:
        return 1.0 if k else 0.9  # clearly faster, every round

    assert len(paired_rounds(time_side, 4, 16, threshold=1.0)[0]) == 8
    assert len(paired_rounds(time_side, 6, 24, threshold=1.0)[0]) == 12
    assert len(paired_rounds(time_side, 4, 6, threshold=1.0)[0]) == 6  # the cap
    assert len(paired_rounds(time_side, 4, 4, threshold=1.0)[0]) == 4
