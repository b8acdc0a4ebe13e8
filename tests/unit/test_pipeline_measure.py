"""Bubble arithmetic on recorded timelines (`partita.pipeline.measure`), checked on
timelines the simulator makes, where the answer is known."""

from __future__ import annotations

import pytest

from partita.pipeline import Costs, build_schedule, simulate
from partita.pipeline.actions import Kind
from partita.pipeline.measure import (
    held_peaks,
    idle_fraction,
    pass_times,
    replay_idle,
    transfer_waits,
)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                    ("zb-h1", 1)])
def test_free_transfers_measure_as_the_simulator_predicts(name, v):
    sched = build_schedule(name, 2, 4, v)
    timeline = simulate(sched, Costs(F=1.0, B=2.0, I=1.0, W=1.0))
    rows = timeline.rows
    assert idle_fraction(rows) == pytest.approx(timeline.bubble_fraction)
    assert replay_idle(sched, rows) == pytest.approx(timeline.bubble_fraction)
    assert transfer_waits(rows) == 0.0


def test_transfer_latency_is_the_gap_between_measured_and_replayed():
    # GPipe, p=2, m=1, by hand: F0 [0,1], F1 [1+c, 2+c], B1 [2+c, 4+c], B0 [4+2c, 6+2c];
    # each of the two receives waits c after its send was posted. (Rank 1's last
    # backward runs as I then W; priced I = B, W = 0 it is the whole B of this sum.)
    c = 0.25
    sched = build_schedule("gpipe", 2, 1)
    rows = simulate(sched, Costs(F=1.0, B=2.0, I=2.0, W=0.0, comm=c)).rows
    makespan = 6 + 2 * c
    assert idle_fraction(rows) == pytest.approx(1 - 6 / (2 * makespan))
    assert replay_idle(sched, rows) == pytest.approx(0.5)  # the same passes, free transfers
    assert transfer_waits(rows) == pytest.approx(2 * c / (2 * makespan))
    assert idle_fraction(rows) - replay_idle(sched, rows) == pytest.approx(transfer_waits(rows))


def test_held_peaks_follow_the_schedule():
    for name, expect in (("gpipe", 4), ("1f1b", 2)):
        rows = simulate(build_schedule(name, 2, 4)).rows
        assert held_peaks(rows)[0] == expect


def test_an_action_recorded_in_two_pieces_counts_once_with_their_sum():
    """Zero bubble's last stage records the head's weight pass as a second piece of its
    I: pass times and the replay add the pieces; held peaks ignore I."""
    sched = build_schedule("zb-h1", 2, 4)
    rows = simulate(sched, Costs(F=1.0, I=1.0, W=1.0)).rows
    last = []
    for a, start, end in rows[1]:  # I split into 0.75 + 0.25, the second piece later
        if a.kind is Kind.I:
            last += [(a, start, end - 0.25), (a, end + 10.0, end + 10.25)]
        else:
            last.append((a, start, end))
    split = [rows[0], last]
    assert pass_times(split) == pytest.approx(pass_times(rows))
    assert replay_idle(sched, split) == pytest.approx(replay_idle(sched, rows))
    assert held_peaks(split) == held_peaks(rows)
