"""The planner's compile option: which mode a layout runs, and its effect on a step
(only where the preset's kernels are partita's eager ones: the CPU preset)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partita.layout import Layout
from partita.models.catalog import get_model_config
from partita.planner.api import make_request
from partita.planner.assumptions import Assumptions
from partita.planner.compiled import compile_in_effect
from partita.planner.evaluate import evaluate
from partita.planner.hardware import GPUS, Cluster
from partita.planner.model_shape import PlanModel
from partita.planner.precision import Precision
from partita.planner.report import format_evaluation
from partita.planner.timing import step_time


def _cpu_like_step(model: str, batch: int, compile: str) -> float:
    # A fixed CPU-like device (the measured profile varies from run to run): 90 GFLOP/s,
    # 25 GB/s, 8 us per eager operation.
    gpu = replace(GPUS["H100"], peak_flops=90e9, memory_bandwidth=25e9, eager_op_s=8e-6,
                  fp32_flops=0.0)  # a CPU's peak is its float32 rate
    return step_time(PlanModel(model, get_model_config(model)),
                     Layout(microbatch_size=batch), Cluster(gpu, 1, 8), 128, batch,
                     Precision.fp32(), Assumptions.measured_cpu(), compile=compile)["step_s"]


def test_the_gain_follows_tokens_and_width():
    """Compiling removes per-operation cost and elementwise traffic, not GEMM time: the
    ratio rises towards 1 with tokens per step and with width (measured on the tiny
    model: 0.71-0.74 at 1x128 tokens to 0.83 at 8x128; 0.95 on llama-20m)."""
    ratio = {(m, b): _cpu_like_step(m, b, "model") / _cpu_like_step(m, b, "none")
             for m, b in (("tiny", 1), ("tiny", 8), ("llama-20m", 4))}
    assert 0.6 < ratio["tiny", 1] < ratio["tiny", 8] < ratio["llama-20m", 4] < 1.0
    assert _cpu_like_step("tiny", 4, "model") < _cpu_like_step("tiny", 4, "blocks") \
        < _cpu_like_step("tiny", 4, "none")
    with pytest.raises(ValueError, match="compile mode"):
        _cpu_like_step("tiny", 4, "fast")


def test_model_mode_falls_back_to_blocks_where_the_trainer_refuses_it():
    assert compile_in_effect("model", Layout(dp=2, zero_stage=1)) == "model"
    for layout in (Layout(dp=2, zero_stage=3), Layout(pp=2), Layout(cp=2),
                   Layout(tp=2, recompute="full")):
        assert compile_in_effect("model", layout) == "blocks"
    assert compile_in_effect("model", Layout(dp=2, recompute="full")) == "model"
    assert compile_in_effect("model", Layout(dp=2, recompute="full"), moe=True) == "blocks"
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
    # The host's floor left out (host_op_s 0): at 512 tokens a step it, not the GPU,
    # would pace every mode alike (tests/unit/test_planner_host.py).
    eager_kernels = replace(Assumptions.partita_on_gpu(), compile_gain=True, host_op_s=0.0)
    layout = Layout(dp=2, zero_stage=1)
    _, eager = _step("none", eager_kernels, layout)
    req, model = _step("model", eager_kernels, layout)
    _, blocks = _step("blocks", eager_kernels, layout)
    assert model.compile == "model" and model.to_dict()["compile"] == "model"
    # A catalog GPU pays nothing per eager operation: the edges compiled under `model`
    # save nothing there, the fused blocks do.
    assert model.time["compute_s"] <= blocks.time["compute_s"] < eager.time["compute_s"]
    # The whole model's backward is one compiled node: the gradient all-reduce and
    # ZeRO-1's parameter all-gather run after it and before the next forward, where
    # blocks and eager steps hide most of them.
    assert blocks.time["comm_exposed_s"] == eager.time["comm_exposed_s"]
    assert model.time["comm_exposed_s"] > 2 * blocks.time["comm_exposed_s"]
    said = format_evaluation(req, model)
    assert "compile: model" in said
    assert "gradient reduce off (compile=model), parameter gather off (compile=model)" in said
    assert model.to_dict()["overlap_assumed"] == dict(
        tp_comm_overlap=False, overlap_grad_reduce=False, overlap_param_gather=False)
    assert blocks.to_dict()["overlap_assumed"]["overlap_grad_reduce"]
    req3, zero3 = _step("model", eager_kernels, Layout(dp=2, zero_stage=3))
    assert zero3.compile == "blocks"
    assert "train.compile=model refuses this layout" in format_evaluation(req3, zero3)


def test_presets_without_eager_kernels_gain_nothing():
    # Fused kernels (Megatron's): nothing left for the compiler to fuse.
    preset = Assumptions()
    assert not preset.compile_gain
    layout = Layout(dp=2, zero_stage=1)
    _, eager = _step("none", preset, layout)
    req, model = _step("model", preset, layout)
    # The same compute; what `model` changes is the overlap it leaves (above).
    assert model.time["compute_s"] == eager.time["compute_s"]
    assert "no gain assumed" in format_evaluation(req, model)


@pytest.mark.parametrize("batch,measured", [(4, 0.82), (8, 0.85)])
def test_partita_on_a_gpu_gains_what_an_h200_measured(batch: int, measured: float):
    """`--implementation partita` on a GPU: compiled blocks against eager for Llama 3.2
    1B in bf16 on one H200 (2026-12-04, tools/device_check.sh; `partita train` and
    `bench gpu --compile`): step-time ratio 0.81-0.84 at 4 x 2048 tokens, 0.85 at 8 x
    2048. The planner, which fuses the counted eager operations, is within 0.05."""
    a = Assumptions.partita_on_gpu()
    assert a.compile_gain
    times = {}
    for mode in ("none", "blocks"):
        req = make_request("llama3.2-1b", 1, "H200", seq_len=2048, global_batch=batch,
                           precision="bf16", assumptions=a, compile=mode)
        times[mode] = evaluate(req, Layout(microbatch_size=batch)).time["step_s"]
    assert times["blocks"] / times["none"] == pytest.approx(measured, abs=0.05)
