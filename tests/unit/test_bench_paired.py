"""Paired benchmark rounds: the median's interval, and rounds doubled only while a
verdict is open. The statistics are pure functions; one short `bench dp` run
(tests/e2e/test_bench_cli.py) checks that the benchmarks wire them in."""

from partita.bench.paired import estimate, paired_rounds, ratios


def test_interval_is_the_order_statistics_around_the_median():
    est = estimate([float(x) for x in range(20, 0, -1)])  # order must not matter
    # n = 20: 2.576 * sqrt(20) / 2 = 5.76 -> ranks round(4.24) = 4 and round(16.76) = 17
    assert (est.median, est.low, est.high, est.rounds) == (10.5, 4.0, 17.0, 20)
    assert est.settled(17.0) and est.settled(3.9) and not est.settled(10.0)


def test_a_single_round_is_its_own_interval():
    est = estimate([0.97])
    assert (est.median, est.low, est.high) == (0.97, 0.97, 0.97)


def sides(ratio_of_round):
    """time_side for paired_rounds: side 1 always takes 1 s, side 0 the round's ratio;
    records the order in which the sides were called."""
    calls: list[int] = []

    def time_side(k: int) -> float:
        calls.append(k)
        return 1.0 if k == 1 else ratio_of_round((len(calls) - 1) // 2)
    return time_side, calls


def test_clear_verdicts_stop_at_the_minimum_and_sides_alternate_first():
    time_side, calls = sides(lambda r: 0.9)
    times = paired_rounds(time_side, 20, 160, threshold=1.0)
    assert len(times[0]) == len(times[1]) == 20
    assert calls[:6] == [0, 1, 1, 0, 0, 1]
    assert ratios(times) == [0.9] * 20


def test_an_open_verdict_doubles_up_to_the_cap():
    time_side, _ = sides(lambda r: 0.9 if r % 2 else 1.1)  # straddles 1.0 for ever
    assert len(paired_rounds(time_side, 20, 70, threshold=1.0)[0]) == 70  # 20, 40, 70


def test_rounds_stop_once_the_interval_clears_the_threshold():
    # Straddling for 20 rounds, then steady at 0.95: settled at the first look after.
    time_side, _ = sides(lambda r: (0.9 if r % 2 else 1.1) if r < 20 else 0.95)
    assert len(paired_rounds(time_side, 20, 160, threshold=1.0)[0]) == 40


def test_without_a_threshold_the_count_is_fixed():
    time_side, _ = sides(lambda r: 0.9 if r % 2 else 1.1)
    assert len(paired_rounds(time_side, 6, 160, threshold=None)[0]) == 6
