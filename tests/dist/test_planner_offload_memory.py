"""Disk offload's host bytes: the planner against the engine's ledger after one step.

The engine (`partita.memory.disk`) holds SETS buffer sets of one sub-group, sized by
the host budget or by the largest owned bucket, whichever is smaller; on a CPU it
stages no gradient. Each case is measured at a budget far above what a small model's
buckets need (the sets hold whole buckets) and at one that binds, at one rank and
two (ZeRO-1 and ZeRO-3, with the parameters on disk too).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from partita.bench.plan_measure import (
    Case,
    measure_cases,
    measure_in_this_process,
    predict,
    rel_error,
    worst_by_stage,
)
from partita.testing import run_distributed

BF16 = "bfloat16"
FREE, TIGHT = 1.0, 0.001  # GB: a budget that does not bind and one that does
CASES = {
    1: [Case(offload="optimizer+disk", host_budget_gb=FREE),
        Case(offload="optimizer+disk", dtype=BF16, host_budget_gb=FREE),
        Case(offload="optimizer+disk", dtype=BF16, host_budget_gb=TIGHT),
        Case(zero=3, offload="optimizer+params+disk", host_budget_gb=FREE)],
    2: [Case(dp=2, zero=1, offload="optimizer+disk", dtype=BF16, host_budget_gb=FREE),
        Case(dp=2, zero=3, offload="optimizer+params+disk", host_budget_gb=FREE),
        Case(dp=2, zero=3, offload="optimizer+params+disk", dtype=BF16,
             host_budget_gb=TIGHT)],
}
TOL = 0.001


def _check(case: Case, measured: dict, stage: int = 0) -> None:
    host, budget = measured["host_model_states"], case.host_budget_gb * 1e9
    # The case is what it says: the budget binds (the sets fill it) or is far off.
    assert (host > 0.9 * budget) == (case.host_budget_gb == TIGHT), (case.label, host)
    predicted = predict(case, stage=stage)
    for term in ("host_model_states", "disk_bytes", "model_states"):
        assert rel_error(predicted[term], measured[term]) <= TOL, \
            (case.label, term, predicted[term], measured[term])


def test_one_rank(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the cases' files
    results = measure_in_this_process(CASES[1])
    for case, measured in zip(CASES[1], results):
        _check(case, measured)


@pytest.mark.parametrize("world", [2])
def test_two_ranks(world: int) -> None:
    per_rank = run_distributed(measure_cases, world, args=(CASES[world],), timeout=170)
    for i, case in enumerate(CASES[world]):
        for stage, measured in worst_by_stage([r[i] for r in per_rank]).items():
            _check(case, measured, stage)
