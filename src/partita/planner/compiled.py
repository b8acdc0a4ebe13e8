"""The effect of `train.compile` on the planner's step time: which mode a layout runs.

    mode = compile_in_effect("model", layout)       # "blocks" where `model` cannot run
    times = step_time(..., compile=mode)
    assumed = overlaps_in_effect(layout, mode)      # `model` overlaps no dp communication

What compiling changes is modelled kernel by kernel (`planner.compute`, counts in
`planner.eager_ops`): a compiled block's elementwise operations (norms, rotary
embedding, SwiGLU, residual adds) become a few generated kernels that move the fused
bytes, instead of ~240 eager operations moving 3-6x as much; its GEMMs, the attention
kernel, the collectives and the optimizer step stay as they are. Under `model` the
embedding, final norm and head are compiled too, and only the loss stays eager. So the
gain follows the model and the tokens per step: large where per-operation cost and
elementwise traffic are a large share of the step (few tokens, narrow models), small
where the GEMMs dominate.

Only a preset whose kernels are partita's eager ones gains (`Assumptions.compile_gain`:
the `cpu` preset and `--implementation partita` on a GPU, each checked against compiled
and eager steps in docs/planner.md); the fused preset already models fused kernels.
"""

from __future__ import annotations

from dataclasses import replace

from partita.compile_rules import MODES, model_refusal
from partita.layout import Layout
from partita.planner.assumptions import Assumptions
from partita.planner.memo import memoised
from partita.planner.model_shape import PlanModel


def compile_in_effect(mode: str, layout: Layout, moe: bool = False) -> str:
    """The mode a run of `layout` compiles with when asked for `mode`: `auto` compiles
    blocks (as the trainer resolves it where the toolchain works), and `model` falls back
    to blocks on a layout that cannot be compiled in one piece (`model_refusal`, `moe`
    for a model with mixture-of-experts blocks: the trainer refuses those, the planner
    shows what blocks would give)."""
    if mode not in MODES:
        raise ValueError(f"compile mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "auto" or (mode == "model" and model_refusal(layout, moe)):
        return "blocks"
    return mode


def overlaps_in_effect(layout: Layout, mode: str) -> Layout:
    """`layout` with the communication overlaps a run compiled with `mode` (the mode in
    effect) keeps. Under `model` the whole backward is one compiled node, so every
    gradient arrives as it ends and the buckets reduce after it, not beside it; and
    ZeRO-1/2 wait for the updated parameters at the compiled unit's edge, the whole
    model, before its forward starts (`ParamAllGather.regroup`). Neither is taken to
    overlap compute then. That holds for a reduction after every microbatch too (ZeRO-2
    accumulating by reduction): the reducer waits for each as the next microbatch's
    `grad_sync` begins, before its forward (`parallelize`'s training step), so none
    hides under the next forward. `blocks` keeps both at block
    granularity: each block's backward is a node of its own, and the waits sit at
    each block."""
    if mode != "model" or not (layout.overlap_grad_reduce or layout.overlap_param_gather):
        return layout
    return replace(layout, overlap_grad_reduce=False, overlap_param_gather=False)


def compiled_activations(a: Assumptions, model: PlanModel, mode: str) -> Assumptions:
    """The assumptions a compiled run's saved activations follow. Inside a compiled
    Llama block (measured with `SavedTensorMeter` on partita's model, fp32 and bf16,
    tests/dist/test_planner_compiled_memory.py) RMSNorm keeps its input and rsqrt
    instead of an fp32 copy and the normalised output, SwiGLU three tensors instead of four (silu(gate)
    is recomputed), and the rotary tables are constants of the graph, not saved per
    block; everything else is what eager saves. GPT-2 blocks (LayerNorm, GELU) save the
    same bytes either way, and an MoE block's experts run eagerly, so both are left as
    they are; so are presets that already describe fused kernels (`compile_gain` off).
    Whatever the model and preset, a compiled block's backward is one node
    (`Assumptions.compiled_blocks`: what a zero-bubble stage holds between I and W).
    Under `model` (`Assumptions.compiled_model`) the final norm compiles too, each block
    saves its rotary tables (the compiled model computes them inside), and a fully
    recomputed block reruns inside the compiled backward: measured against `blocks` on
    plan-accuracy's model (the final norm 4 bytes per token and hidden element fewer,
    2 x seq x head_dim/2 table elements more per block)."""
    if mode == "none":
        return a
    a = _whole_block_backward(a)
    if (not a.compile_gain or a.norm_kernel != "eager"
            or model.config.flavour != "llama" or model.is_moe):
        return a
    a = _compiled_block_activations(a)
    return _compiled_model_activations(a) if mode == "model" else a


# One object per search, not one per layout: memoised terms know it by identity.
@memoised()
def _whole_block_backward(a: Assumptions) -> Assumptions:
    return replace(a, compiled_blocks=True)


@memoised()
def _compiled_block_activations(a: Assumptions) -> Assumptions:
    return replace(a, norm_kernel="compiled", swiglu_saved_tensors=3,
                   rotary_tables_saved=False)


@memoised()
def _compiled_model_activations(a: Assumptions) -> Assumptions:
    return replace(a, compiled_model=True, rotary_tables_saved=True)
