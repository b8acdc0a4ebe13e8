"""The planner's compile option scales the compute part of a step and the rates with it."""

from __future__ import annotations

import pytest

from partita.planner.compiled import with_compile

TIMES = {"step_s": 10.0, "compute_s": 8.0, "tokens_per_s": 100.0, "mfu": 0.3,
         "comm_exposed_s": 2.0}


def test_compiling_shortens_compute_only_and_rescales_the_rates():
    assert with_compile(TIMES, "none", 0.5) == TIMES
    got = with_compile(TIMES, "blocks", 0.5)
    assert got["compute_s"] == pytest.approx(4.0)
    assert got["step_s"] == pytest.approx(6.0)  # the exposed communication stays
    assert got["comm_exposed_s"] == 2.0
    assert got["tokens_per_s"] == pytest.approx(100.0 * 10 / 6)
    assert got["mfu"] == pytest.approx(0.3 * 10 / 6)
    with pytest.raises(ValueError, match="compile mode"):
        with_compile(TIMES, "fast")
