"""How many eager PyTorch operations partita's own model runs: the host-side cost of a step.

    fwd, bwd = block_ops(model, layout)      # one block, one microbatch
    fwd, bwd = edge_ops(model)                # embedding, final norm, head and loss
    fwd, bwd = block_bytes(model, layout, 4)  # bytes per token its elementwise ops move
    ops = step_ops(local_params, 2, a)        # clipping and the AdamW step of a rank

On a CPU every operation costs its dispatch, autograd bookkeeping and allocation in
line with its work (`GPUSpec.eager_op_s`, 5-12 us here), and a small model's step is
mostly that: the plan-accuracy model (dim 64, 64 tokens per step) runs ~600 operations
and ~1.6 ms of kernel work in ~5 ms. A GPU launches ahead of its kernels, so there the
cost is hidden and its profiles leave `eager_op_s` at 0.

The counts are aten operations as a `TorchDispatchMode` sees them (views included),
taken from partita's `Transformer` and `partita.loss.cross_entropy`, forward with
autograd recording and backward, at one and two blocks (the difference is a block);
tests/unit/test_eager_ops.py counts them again and fails when the model drifts from
this table. Layout-specific operations (tensor-parallel f/g, collectives, pipeline
sends) are left out: communication is timed on its own.
"""

from __future__ import annotations

import math

from partita.layout import Layout
from partita.planner.assumptions import Assumptions
from partita.planner.model_shape import PlanModel

# (forward, backward) operations of one dense block, per flavour: llama (RMSNorm,
# rotary embedding, grouped-query attention, SwiGLU) and gpt2 (LayerNorm, biases, GELU).
BLOCK_OPS = {"llama": (79, 131), "gpt2": (39, 93)}
# With 16-bit parameters llama's rotary embedding casts q and k to float32 around its
# complex products (`models.rotary.RotateInFloat32`), and the loss and norms cast:
# more operations in the block and outside it.
ROTARY_16BIT_OPS = (10, 7)
CAST_EDGE_OPS = {"llama": (3, 3), "gpt2": (1, 1)}
# An MoE block without its experts (router, top-k, dispatch and combine), and each
# expert this rank holds (its tokens' gather, three GEMMs, SwiGLU, scatter-add).
MOE_BLOCK_OPS = (130, 169)
EXPERT_OPS = (12, 20)
# Dropout > 0: a mask and its product after attention and after the MLP.
DROPOUT_BLOCK_OPS = (8, 2)
DROPOUT_EDGE_OPS = (4, 1)
# Explicit-score attention (`models.transformer.explicit_attention`) in place of torch's
# kernel: its scaling, copies, mask, softmax and the products' reshapes (counted as
# BLOCK_OPS are: 25 and 24 more, llama and gpt2, fp32 and bf16), and per token the bytes
# its width-h pieces move, e * h / t times these (Q scaled and copied into the grouped
# layout, K and V made contiguous for the batched products; measured 8.75-10.75 forward,
# 5-8 backward); the scores' own bytes are attention's (`compute.attention_core`).
EXPLICIT_ATTENTION_OPS = (25, 24)
EXPLICIT_ATTENTION_BYTES = (9.0, 6.0)
# Embedding, final norm, output layer and the loss.
EDGE_OPS = {"llama": (26, 35), "gpt2": (23, 24)}
# Compiled (`train.compile`, inductor): a block's elementwise operations become a few
# generated kernels that move the fused bytes (4 forward and 6 backward per llama block
# in inductor's output for the tiny model: 17 and 26 over 4 blocks and the head); the
# GEMMs and the attention kernel stay calls of their own. Under `model` the embedding,
# final norm and head are compiled too and only the loss (10 and 8) stays eager.
COMPILED_BLOCK_KERNELS = (4, 6)
COMPILED_EDGE_OPS = (13, 13)
# What the host spends on a compiled graph besides its kernels' work, in eager
# operations' worth (`GPUSpec.eager_op_s`), forward and backward. Each kernel call inside
# the graph costs about 2.7 and 2.5 (its wrapper allocates and frees the buffers around
# it), and each call of a compiled region 31 and 18 more (guards, the runtime wrappers,
# the autograd function around the graph). Measured on partita's tiny block at one token,
# where the kernels' work is negligible (1 and 4 blocks, eager, compiled blocks and the
# compiled model, 15 interleaved rounds of 50 passes, 2026-12-05): a block inside a
# compiled model took 32 and 52 operations' worth for its 12 and 21 kernels, as its
# own region 63 and 70, and eager 100 and 114 (counted: 79 and 131).
COMPILED_CALL_OPS = (2.7, 2.5)
COMPILED_REGION_OPS = (31.0, 18.0)
# Bytes per token that a block's elementwise operations (everything but GEMMs, the
# attention kernel and views) read and write, forward and backward, as c_h * h + c_f *
# ffn, per flavour and parameter width (bf16 norms compute in fp32): eager PyTorch
# moves 3-6x what fused kernels would (llama: RMSNorm's six passes, the rotary
# embedding's product, SwiGLU's saved products; in bf16 the rotary's float32 casts).
BLOCK_BYTES = {("llama", 4): ((123, 20), (295, 36)), ("llama", 2): ((146, 10), (282.5, 18)),
               ("gpt2", 4): ((41, 8), (94, 16)), ("gpt2", 2): ((20.5, 4), (47, 8))}
# What the byte count leaves out (aten names): GEMMs and attention, timed on their own;
# views and allocations, which move no data.
NOT_ELEMENTWISE = frozenset({
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "view", "t", "transpose", "_unsafe_view", "unsqueeze", "detach", "slice", "expand",
    "as_strided", "select", "permute", "squeeze", "alias", "split", "unbind",
    "_reshape_alias", "reshape", "lift_fresh", "arange", "empty", "zeros", "full"})
# Gradient clipping and partita's AdamW step, operations that launch a kernel: a fixed
# part (the norm's sum and its read), and per flat buffer (a gradient bucket; a gather
# unit under ZeRO-3) its norms, the two fused updates (decayed and not), the step
# count's tensor and the clip's product. Each buffer holds the parameters AdamW decays
# first (`zero.flat`), so the count does not grow with the parameters in it. Views of
# the buffers (about 14 per buffer) are left out: a slice costs the host about 1 us, a
# fifth of an operation that launches a kernel (measured on a CPU). Counted in fp32 on
# a CPU with a TorchDispatchMode: 12 for the tiny model (one bucket), 100 for gpt2-124m
# (16 buckets).
STEP_OPS = (6, 6)


def _flavour(model: PlanModel) -> str:
    return "gpt2" if model.config.flavour == "gpt2" else "llama"


def block_ops(model: PlanModel, layout: Layout, elem_bytes: int = 4, explicit: bool = False
              ) -> tuple[float, float]:
    """(forward, backward) operations of one block of `model` for one microbatch with
    `elem_bytes`-wide parameters, its attention `explicit` scores or torch's kernel; an
    MoE model's blocks are MoE blocks (`PlanModel.dense_blocks` gives the dense ones)."""
    if model.is_moe:
        experts = model.moe.num_experts / (layout.ep * layout.experts_over_tp)
        fwd = MOE_BLOCK_OPS[0] + experts * EXPERT_OPS[0]
        bwd = MOE_BLOCK_OPS[1] + experts * EXPERT_OPS[1]
    else:
        fwd, bwd = BLOCK_OPS[_flavour(model)]
    if model.config.dropout > 0:
        fwd, bwd = fwd + DROPOUT_BLOCK_OPS[0], bwd + DROPOUT_BLOCK_OPS[1]
    if elem_bytes <= 2 and _flavour(model) == "llama":
        fwd, bwd = fwd + ROTARY_16BIT_OPS[0], bwd + ROTARY_16BIT_OPS[1]
    if explicit:
        fwd, bwd = fwd + EXPLICIT_ATTENTION_OPS[0], bwd + EXPLICIT_ATTENTION_OPS[1]
    return float(fwd), float(bwd)


def compiled_block_ops(model: PlanModel, explicit: bool = False) -> tuple[float, float]:
    """(forward, backward) host cost of one compiled dense block inside a compiled graph,
    in eager operations' worth: its kernel calls (each linear layer's GEMM, two in
    backward, the attention kernel or, for `explicit` scores, two batched products
    forward and four backward, and the generated kernels) at `COMPILED_CALL_OPS`.
    A compiled region's own calls are `COMPILED_REGION_OPS` on top."""
    linears = 4 + (3 if model.config.gated_mlp else 2)
    fused_fwd, fused_bwd = COMPILED_BLOCK_KERNELS
    core_fwd, core_bwd = (2, 4) if explicit else (1, 1)
    return ((linears + core_fwd + fused_fwd) * COMPILED_CALL_OPS[0],
            (2 * linears + core_bwd + fused_bwd) * COMPILED_CALL_OPS[1])


def block_bytes(model: PlanModel, layout: Layout, elem_bytes: int, explicit: bool = False
                ) -> tuple[float, float]:
    """(forward, backward) bytes per token a block's elementwise operations move on one
    rank, with `elem_bytes`-wide parameters: width-h work is split over tp only under
    sequence parallelism, the MLP's over tp (an MoE's tokens visit top_k experts);
    `explicit`: attention's width-h pieces around explicit scores too."""
    c = model.config
    (fh, ff), (bh, bf) = BLOCK_BYTES[_flavour(model), 2 if elem_bytes <= 2 else 4]
    t = layout.tp
    h = c.dim / t if layout.sequence_parallel or t == 1 else c.dim
    ffn = (model.expert_ffn * model.moe.top_k / layout.expert_tp if model.is_moe
           else c.ffn_hidden / t)
    fwd, bwd = fh * h + ff * ffn, bh * h + bf * ffn
    if explicit:
        width = elem_bytes * c.dim / t
        fwd, bwd = (fwd + EXPLICIT_ATTENTION_BYTES[0] * width,
                    bwd + EXPLICIT_ATTENTION_BYTES[1] * width)
    return fwd, bwd


def edge_ops(model: PlanModel, elem_bytes: int = 4) -> tuple[float, float]:
    """(forward, backward) operations outside the blocks for one microbatch."""
    fwd, bwd = EDGE_OPS[_flavour(model)]
    if elem_bytes <= 2:
        cast_fwd, cast_bwd = CAST_EDGE_OPS[_flavour(model)]
        fwd, bwd = fwd + cast_fwd, bwd + cast_bwd
    if model.config.dropout > 0:
        fwd, bwd = fwd + DROPOUT_EDGE_OPS[0], bwd + DROPOUT_EDGE_OPS[1]
    return float(fwd), float(bwd)


def step_ops(local_params: float, elem_bytes: int, a: Assumptions) -> float:
    """Operations of clipping and the optimizer step on a rank holding `local_params`
    parameters of `elem_bytes` each, in flat buffers of about `a.zero_bucket_bytes`."""
    fixed, per_buffer = STEP_OPS
    buffers = max(1, math.ceil(local_params * elem_bytes / a.zero_bucket_bytes))
    return float(fixed + per_buffer * buffers)
