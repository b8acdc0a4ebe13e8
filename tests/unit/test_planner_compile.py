"""The planner's compile option: which mode a layout runs, and its measured effect on
the compute part of a step (only where the preset is the one the factors were measured
on: partita's eager kernels on CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partita.layout import Layout
from partita.planner.api import make_request
from partita.planner.assumptions import Assumptions
from partita.planner.compiled import COMPUTE_FACTORS, compile_in_effect, with_compile
from partita.planner.evaluate import evaluate
from partita.planner.report import format_evaluation

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
    assert with_compile(TIMES, "model")["compute_s"] == pytest.approx(
        8.0 * COMPUTE_FACTORS["model"])
    with pytest.raises(ValueError, match="compile mode"):
        with_compile(TIMES, "fast")


def test_model_mode_falls_back_to_blocks_where_the_trainer_refuses_it():
    assert compile_in_effect("model", Layout(dp=2, zero_stage=1)) == "model"
    for layout in (Layout(dp=2, zero_stage=3), Layout(pp=2), Layout(cp=2),
                   Layout(dp=2, recompute="full")):
        assert compile_in_effect("model", layout) == "blocks"
    assert compile_in_effect("auto", Layout(dp=2)) == "blocks"
    assert compile_in_effect("none", Layout(dp=2)) == "none"


def _step(compile: str, assumptions: Assumptions, layout: Layout):
    # A GPU from the table (the CPU's figures are measured, so they vary run to run).
    req = make_request("llama-20m", 2, "H100", seq_len=128, global_batch=8,
                       precision="bf16", assumptions=assumptions, compile=compile)
    return req, evaluate(req, layout)


def test_evaluate_applies_the_mode_in_effect_and_says_which():
    assert Assumptions.measured_cpu().compile_gain
    # The CPU preset's gain on a GPU from the table: the CPU's own figures are measured
    # at each request, so two requests would differ by more than the factor.
    eager_kernels = replace(Assumptions.partita_on_gpu(), compile_gain=True)
    layout = Layout(dp=2, zero_stage=1)
    _, eager = _step("none", eager_kernels, layout)
    req, model = _step("model", eager_kernels, layout)
    _, blocks = _step("blocks", eager_kernels, layout)
    assert model.compile == "model" and model.to_dict()["compile"] == "model"
    assert model.time["compute_s"] == pytest.approx(
        eager.time["compute_s"] * COMPUTE_FACTORS["model"])
    assert blocks.time["compute_s"] == pytest.approx(
        eager.time["compute_s"] * COMPUTE_FACTORS["blocks"])
    assert model.time["step_s"] < eager.time["step_s"]
    assert "compile: model" in format_evaluation(req, model)
    req3, zero3 = _step("model", eager_kernels, Layout(dp=2, zero_stage=3))
    assert zero3.compile == "blocks"
    assert "train.compile=model refuses this layout" in format_evaluation(req3, zero3)


@pytest.mark.parametrize("preset", [Assumptions(), Assumptions.partita_on_gpu()])
def test_presets_the_factors_were_not_measured_on_gain_nothing(preset: Assumptions):
    # Fused kernels (Megatron's), and partita on a GPU, where nothing is measured yet.
    assert not preset.compile_gain
    layout = Layout(dp=2, zero_stage=1)
    _, eager = _step("none", preset, layout)
    req, model = _step("model", preset, layout)
    assert model.time["step_s"] == eager.time["step_s"]
    assert "no gain assumed" in format_evaluation(req, model)
