"""Interleaved 1F1B with full recompute: the planner's activations against the meter.

The interleaved schedule splits no backward into I and W, so no stage holds a
microbatch's graph whole while a layer reruns (1F1B's last backward does); and with
`recompute_layers = K` the rank's first K blocks rerun, which sit in its first chunks,
of which the schedule holds more microbatches than of its last. Each stage of two,
every block, the first block only and a K that ends inside a chunk; the planner was
26%, 64% and 55% over on stage 1 before it counted either.
"""

from __future__ import annotations

from dataclasses import replace

from partita.bench.plan_measure import (
    Case,
    Shape,
    measure_cases,
    predict,
    rel_error,
    worst_by_stage,
)
from partita.testing import run_distributed

DEEP = Shape(n_layers=4)
CASES = [Case(pp=2, microbatches=4, schedule="interleaved-1f1b", vpp=2, shape=DEEP,
              recompute="full"),
         Case(pp=2, microbatches=4, schedule="interleaved-1f1b", vpp=2, shape=DEEP,
              recompute="full", recompute_layers=1),
         # Two blocks per chunk: the third block reruns, the fourth does not.
         Case(pp=2, microbatches=4, schedule="interleaved-1f1b", vpp=2,
              shape=replace(DEEP, n_layers=8), recompute="full", recompute_layers=3)]
TOL = 0.01


def test_interleaved_stages_with_full_recompute() -> None:
    per_rank = run_distributed(measure_cases, 2, args=(CASES,), timeout=170)
    for i, case in enumerate(CASES):
        for stage, measured in worst_by_stage([r[i] for r in per_rank]).items():
            predicted = predict(case, stage=stage)["activations"]
            assert rel_error(predicted, measured["activations"]) <= TOL, \
                (case.label, stage, predicted, measured["activations"])
