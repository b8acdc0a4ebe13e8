"""Interleaved 1F1B under recompute: the planner's walk of the schedule
(`planner.schedule_peaks.interleaved_peak`, for a recompute of the first K blocks) gives the
closed form's figure where every layer reruns (each chunk alike), and weighs the
chunks by how many microbatches of each the schedule holds where only some rerun.
Measured against the meter in tests/dist/test_planner_interleaved_recompute.py.
"""

from __future__ import annotations

import pytest

from partita.bench.plan_measure import Case, Shape, plan_model
from partita.planner import Assumptions, Layout
from partita.planner.activation_memory import (
    layer_activation_bytes,
    recompute_transient_bytes,
)
from partita.planner.memory import activation_bytes
from partita.planner.precision import Precision
from partita.planner.schedule_peaks import interleaved_peak

MODEL = plan_model(Case(shape=Shape(n_layers=16)))
A, P, SEQ = Assumptions.measured_cpu(), Precision.fp32(), 32


@pytest.mark.parametrize("v,m", [(2, 4), (2, 8), (4, 8)])
def test_the_walk_is_the_closed_form_when_every_layer_reruns(v, m) -> None:
    """The middle stages of pp 4 (no token ids, no loss): 4 layers, all rerun."""
    layout = Layout(pp=4, schedule="interleaved-1f1b", virtual_stages=v, recompute="full")
    plain = layout.with_(recompute="none")
    per_rc = layer_activation_bytes(MODEL, layout, SEQ, P, A)
    per_none = layer_activation_bytes(MODEL, plain, SEQ, P, A)
    rerun = recompute_transient_bytes(MODEL, layout, SEQ, P, A)
    for stage in (1, 2):
        walk = interleaved_peak(layout, m, stage, 4, 4, per_rc, per_none, rerun,
                                 loss_side=0.0, ids=0.0, bias=0.0, released=0.0)
        assert walk == pytest.approx(activation_bytes(MODEL, layout, SEQ, m, stage, P, A),
                                     rel=1e-12)
        # Three of four rerun: between all and none.
        partial = activation_bytes(MODEL, layout.with_(recompute_layers=3), SEQ, m, stage,
                                   P, A)
        assert walk < partial < activation_bytes(MODEL, plain, SEQ, m, stage, P, A)


def test_the_first_chunks_outnumber_the_last() -> None:
    """pp 2, v 2, stage 0: five microbatch-chunks in flight at the warm-up's end, three
    of chunk 0 and two of chunk 1; with chunk 0 recomputed and chunk 1 not, the peak
    weights them 3:2, not 2.5:2.5."""
    layout = Layout(pp=2, schedule="interleaved-1f1b", virtual_stages=2, recompute="full",
                    recompute_layers=1)
    peak = interleaved_peak(layout, 4, 0, 2, 1, per_recomputed=1.0, per_kept=10.0,
                             rerun=0.0, loss_side=0.0, ids=0.0, bias=0.0, released=0.0)
    assert peak == 3 * 1.0 + 2 * 10.0
