"""Compute time of one transformer block: each GEMM, attention and the memory-bound rest.

A single "efficiency" constant cannot explain why a 1T-parameter model reaches a higher
MFU than a 2B one on the same GPUs. This module times every kernel of a block from its
shape instead, with a roofline and a few named shape effects (docs/planner.md):

* roofline: a kernel takes max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth);
* tile quantisation: a GEMM computes whole `gemm_tile` x `gemm_tile` output tiles, so
  a dimension of 100 costs as much as one of 128;
* short inner dimension: each output tile's main loop runs over K; prologue and
  epilogue cost about `gemm_k_half` steps of it, so the rate is scaled by K/(K + k_half)
  (attention's inner dimension is the head dimension, so small heads run slower);
* alignment: a GEMM whose n or k is not a multiple of `gemm_align` (8) elements runs at
  `misaligned_gemm_fraction` (0.2) of the rate, as measured on an H200;
* launch overhead: a fixed `kernel_overhead_s` per kernel;
* memory-bound work (norms, activations, residual adds, dropout, softmax, the loss)
  moves a fixed number of bytes per hidden element per token, at memory bandwidth;
* eager operations: on a device whose profile gives `eager_op_s` (a CPU), every
  operation of partita's eager model costs that much besides its work
  (`planner.eager_ops` counts them); on a GPU the host launches them ahead of their
  kernels at `Assumptions.host_op_s` each, a floor under the GPU's time (`host_times`).

Why a wider model reaches a higher MFU: a block's GEMM FLOPs grow as h^2 per token while
its memory-bound bytes grow as h (and its eager softmax as heads x seq), so the share
of time spent at memory speed falls as 1/h; and the GEMMs' inner dimensions (h, ffn/tp)
grow, so K/(K + k_half) approaches 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partita.layout import OVERLAP_OPTIONS, Layout
from partita.planner.activation_memory import explicit_scores
from partita.planner.assumptions import Assumptions
from partita.planner.context_parallel import attention_pairs_fraction
from partita.planner.eager_ops import (
    COMPILED_EDGE_OPS,
    COMPILED_REGION_OPS,
    block_bytes,
    block_ops,
    compiled_block_ops,
    edge_ops,
)
from partita.planner.hardware import GPUSpec, gpu_family
from partita.planner.memo import memoised
from partita.planner.model_shape import PlanModel
from partita.planner.stage_params import vocab_rows


@dataclass(frozen=True)
class BlockTimes:
    """Seconds of one block for one microbatch on one GPU, split the way recomputation
    needs: `attention_core_fwd` is what selective recomputation repeats."""

    fwd: float  # whole forward (GEMMs + attention + memory-bound)
    bwd: float  # whole backward
    attention_core_fwd: float  # score, softmax (+ dropout), value product, forward
    attention_core_bwd: float  # ... and its backward
    gemm_fwd: float  # the four weight GEMMs of the forward (what TP overlap can hide under)


def gemm_time(m: float, n: float, k: float, gpu: GPUSpec, a: Assumptions,
              batch: float = 1, elem_bytes: int = 2) -> float:
    """Seconds of `batch` products (m x k) @ (k x n) in a 16-bit (or `elem_bytes`) dtype."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    tile = a.gemm_tile
    if tile > 0:  # whole output tiles are computed
        mm, nn = math.ceil(m / tile) * tile, math.ceil(n / tile) * tile
    else:
        mm, nn = m, n
    flops = 2.0 * mm * nn * k * batch
    rate = gpu.peak_flops * gemm_fraction(gpu, a) * k / (k + a.gemm_k_half)
    if a.gemm_align and (misaligned(n, a.gemm_align) or misaligned(k, a.gemm_align)):
        rate *= a.misaligned_gemm_fraction  # no vectorised tensor-core kernel
    moved = elem_bytes * batch * (m * k + k * n + m * n)
    return max(flops / rate, moved / (gpu.memory_bandwidth * a.memory_efficiency)) \
        + a.kernel_overhead_s


def misaligned(dim: float, align: int) -> bool:
    """A whole dimension off a multiple of `align` (a fractional one is an average over
    ranks or pieces, not a tensor's shape, and is not judged)."""
    return float(dim).is_integer() and int(dim) % align != 0


def gemm_fraction(gpu: GPUSpec, a: Assumptions) -> float:
    """Fraction of datasheet peak that large GEMMs sustain on `gpu` (assumption, or the
    per-family default of `GEMM_PEAK_FRACTION`)."""
    if a.gemm_peak_fraction > 0:
        return a.gemm_peak_fraction
    return family_gemm_fraction(gpu)


def family_gemm_fraction(gpu: GPUSpec) -> float:
    """`GEMM_PEAK_FRACTION` of the catalog family whose kernels `gpu` runs
    (`hardware.gpu_family`: a --hardware profile's base, whatever the profile's own
    name); the default for a profile without a base."""
    family = gemm_family(gpu)
    return GEMM_PEAK_FRACTION[family] if family else GEMM_PEAK_FRACTION["default"]


def gemm_family(gpu: GPUSpec) -> str:
    """The `GEMM_PEAK_FRACTION` family `gpu` belongs to ("" for none: the default)."""
    family = gpu_family(gpu).upper()
    # By prefix of a catalog name: A100-40GB and A100-80GB are A100s.
    return next((f for f in GEMM_PEAK_FRACTION if f != "default" and family.startswith(f)),
                "")


# What large bf16 GEMMs sustain in a training step, as a fraction of dense datasheet
# peak (clocks under sustained load, cuBLAS kernels); see docs/planner.md for sources.
GEMM_PEAK_FRACTION = {"A100": 0.78, "H100": 0.68, "H200": 0.70, "B200": 0.68,
                      "default": 0.75}


def memory_time(nbytes: float, gpu: GPUSpec, a: Assumptions, kernels: int = 1) -> float:
    return nbytes / (gpu.memory_bandwidth * a.memory_efficiency) + kernels * a.kernel_overhead_s


def attention_core(model: PlanModel, layout: Layout, seq_len: int, gpu: GPUSpec,
                   a: Assumptions, elem_bytes: int = 2) -> tuple[float, float]:
    """(forward, backward) seconds of the score/softmax/value part for one microbatch.

    Flash kernels skip the masked half of a causal score matrix and reach
    `flash_fwd_fraction` / `flash_bwd_fraction` of the GEMM rate (the backward
    recomputes the scores: 2.5x the forward's FLOPs). Eager attention runs two batched
    GEMMs each way and moves the s x s scores through softmax (and dropout) in memory.
    """
    c = model.config
    heads = c.n_heads / layout.tp
    b, hd = layout.microbatch_size, c.head_dim
    q = seq_len / layout.cp  # this rank's queries; keys: the whole sequence (ring)
    kv = seq_len
    if layout.cp > 1 and a.cp_eager_pieces and not a.cp_fused_pieces:
        # Explicit-score pieces (planner.context_parallel): the rank's queries meet
        # (2c+2)/(4c) of the sequence's keys on average, the own pair's block whole.
        kv = seq_len * attention_pairs_fraction(layout) * layout.cp
    elif not explicit_scores(model, layout, seq_len, elem_bytes, a):
        flops = 4.0 * b * heads * q * kv * hd * 0.5  # causal: masked tiles skipped
        rate = gpu.peak_flops * gemm_fraction(gpu, a) * hd / (hd + a.gemm_k_half)
        fwd = flops / (rate * a.flash_fwd_fraction) + a.kernel_overhead_s
        bwd = 2.5 * flops / (rate * a.flash_bwd_fraction) + a.kernel_overhead_s
        return fwd, bwd
    bh = b * heads
    scores = bh * q * kv
    per_score = elem_bytes / 2  # the softmax bytes are given for 16-bit scores
    e = elem_bytes
    fwd = (gemm_time(q, kv, hd, gpu, a, bh, e) + gemm_time(q, hd, kv, gpu, a, bh, e)
           + memory_time(a.eager_softmax_bytes_fwd * per_score * scores, gpu, a, 2))
    bwd = (2 * gemm_time(q, kv, hd, gpu, a, bh, e) + 2 * gemm_time(q, hd, kv, gpu, a, bh, e)
           + memory_time(a.eager_softmax_bytes_bwd * per_score * scores, gpu, a, 2))
    return fwd, bwd


# A block's time reads tp, cp, ep, the microbatch size, sequence parallelism and moe_tp;
# a search computes it once per value of those (`planner.memo`).
@memoised(ignores=("dp", "pp", "zero_stage", "schedule", "virtual_stages", "recompute",
                   "recompute_layers", "offload", "cp_kind", *OVERLAP_OPTIONS))
def block_times(model: PlanModel, layout: Layout, seq_len: int, gpu: GPUSpec,
                a: Assumptions, elem_bytes: int = 2, compiled: str = "none") -> BlockTimes:
    """Kernel-by-kernel time of one block (dense or MoE) for one microbatch on one GPU,
    `elem_bytes`-wide parameters (what partita's eager elementwise operations move,
    `Assumptions.eager_elementwise`). `compiled` ("blocks" or "model"): the block runs
    compiled, its elementwise operations fused into a few kernels (a dense block of
    partita's eager model; an MoE block's routing stays as it is), under "blocks" as a
    compiled region of its own."""
    c = model.config
    t, h = layout.tp, c.dim
    tokens = layout.microbatch_size * seq_len / layout.cp
    kv = c.kv_heads * c.head_dim
    ffn = model.expert_ffn if model.is_moe else c.ffn_hidden
    up = ffn * (2 if c.gated_mlp else 1)
    # MoE: each token visits top_k experts; the expert GEMMs see tokens*top_k rows
    # spread over the experts of this rank (fewer rows each: less efficient).
    mlp_rows = tokens
    mlp_count = 1.0
    mlp_t = t  # dense MLPs are tensor-parallel; experts: see moe_tp
    if model.is_moe:  # replicated or split over tp by experts (E / (tp * ep) per rank)
        mlp_t = t if layout.moe_tp == "hidden" else 1  # ... or by width (E / ep, ffn / tp)
        local_experts = model.moe.num_experts / (layout.ep * layout.experts_over_tp)
        mlp_rows = tokens * model.moe.top_k * layout.ep / model.moe.num_experts
        mlp_count = local_experts
    kv_local = math.ceil(c.kv_heads / t) * c.head_dim if kv else 0
    weights = [  # (m, n, k, count) of the forward GEMMs
        (tokens, h / t + 2 * kv_local, h, 1.0),  # q, k, v projections
        (tokens, h, h / t, 1.0),  # attention output projection
        (mlp_rows, up / mlp_t, h, mlp_count),  # MLP up (and gate)
        (mlp_rows, h, ffn / mlp_t, mlp_count),  # MLP down
    ]
    shared_elems = 0.0
    if model.is_moe:
        # The router scores every token against every expert (whole on each tp rank),
        # and the shared experts run every token (their width split over tp where the
        # experts are, `PlanModel.block_split`): GEMMs as large as an expert's.
        weights.append((tokens, model.moe.num_experts, h, 1.0))
        if c.shared_experts:
            width = c.shared_experts * model.expert_ffn
            shared_t = t if layout.moe_tp != "replicate" else 1
            shared_up = width * (2 if c.gated_mlp else 1)
            weights += [(tokens, shared_up / shared_t, h, 1.0),
                        (tokens, h, width / shared_t, 1.0)]
            shared_elems = (shared_up + width) / shared_t
    # Operands as wide as the parameters: fp32 training moves twice a bf16 one's bytes.
    e = elem_bytes
    gemm_fwd = sum(n_ * gemm_time(m, n, k, gpu, a, elem_bytes=e) for m, n, k, n_ in weights)
    # Backward: the input gradient (m x k from m x n) and the weight gradient (k x n).
    gemm_bwd = sum(n_ * (gemm_time(m, k, n, gpu, a, elem_bytes=e)
                         + gemm_time(k, n, m, gpu, a, elem_bytes=e))
                   for m, n, k, n_ in weights)
    core_fwd, core_bwd = attention_core(model, layout, seq_len, gpu, a, elem_bytes)
    # Memory-bound elementwise work per token: two norms (read + write h each), two
    # residual adds (read 2h, write h), the activation (read up, write ffn), dropout
    # masks when the model has dropout; backward moves about twice the forward's bytes.
    # Width-h work is split over tp only under sequence parallelism.
    h_share = h / t if layout.sequence_parallel or t == 1 else h
    h_elems = (2 * 2 + 2 * 3 + (2 * 1.5 if c.dropout > 0 else 0)) * h_share
    f_elems = (up + ffn) / mlp_t * (mlp_count * mlp_rows / tokens if model.is_moe else 1)
    f_elems += shared_elems
    moved_fwd = a.activation_elem_bytes * tokens * (h_elems + f_elems)
    moved_bwd = 2 * moved_fwd
    explicit = explicit_scores(model, layout, seq_len, elem_bytes, a)
    ops_fwd, ops_bwd = block_ops(model, layout, elem_bytes, explicit)
    if compiled != "none" and a.eager_elementwise and not model.is_moe:
        # Fused by the compiler: the fused bytes at the run's width, few kernel calls.
        moved_fwd = elem_bytes * tokens * (h_elems + f_elems)
        moved_bwd = 2 * moved_fwd
        ops_fwd, ops_bwd = compiled_block_ops(model, explicit)
        if compiled == "blocks":
            ops_fwd, ops_bwd = ops_fwd + COMPILED_REGION_OPS[0], ops_bwd + COMPILED_REGION_OPS[1]
    elif a.eager_elementwise:  # partita's eager operations, counted (planner.eager_ops)
        moved_fwd, moved_bwd = (tokens * b for b in block_bytes(model, layout, elem_bytes,
                                                                 explicit))
    mem_fwd = memory_time(moved_fwd, gpu, a, a.elementwise_kernels)
    mem_bwd = memory_time(moved_bwd, gpu, a, a.elementwise_kernels)
    mem_fwd += ops_fwd * gpu.eager_op_s
    mem_bwd += ops_bwd * gpu.eager_op_s
    return BlockTimes(fwd=gemm_fwd + core_fwd + mem_fwd, bwd=gemm_bwd + core_bwd + mem_bwd,
                      attention_core_fwd=core_fwd, attention_core_bwd=core_bwd,
                      gemm_fwd=gemm_fwd)


@memoised(ignores=("dp", "pp", "ep", "zero_stage", "schedule", "virtual_stages",
                   "sequence_parallel", "recompute", "recompute_layers", "offload", "cp_kind",
                   "moe_tp", *OVERLAP_OPTIONS))  # reads tp, cp and the microbatch size
def head_times(model: PlanModel, layout: Layout, seq_len: int, gpu: GPUSpec,
               a: Assumptions, compiled: bool = False, elem_bytes: int = 2
               ) -> tuple[float, float]:
    """(forward, backward) seconds of the output layer and the loss for one microbatch;
    `compiled`: the embedding, final norm and head compiled with the blocks, the whole
    model one compiled region (its calls counted here)."""
    c = model.config
    tokens = layout.microbatch_size * seq_len / layout.cp
    v = vocab_rows(model, layout)  # rows per rank
    e = elem_bytes
    fwd = gemm_time(tokens, v, c.dim, gpu, a, elem_bytes=e)
    bwd = (gemm_time(tokens, c.dim, v, gpu, a, elem_bytes=e)
           + gemm_time(c.dim, v, tokens, gpu, a, elem_bytes=e))
    loss = memory_time(a.loss_bytes_per_logit * tokens * v, gpu, a, 4)
    if compiled:
        ops_fwd, ops_bwd = (e + r for e, r in zip(COMPILED_EDGE_OPS, COMPILED_REGION_OPS))
    else:
        ops_fwd, ops_bwd = edge_ops(model, elem_bytes)
    return (fwd + loss / 2 + ops_fwd * gpu.eager_op_s,
            bwd + loss / 2 + ops_bwd * gpu.eager_op_s)


def optimizer_time(local_params: float, gpu: GPUSpec, a: Assumptions,
                   operations: float = 0.0) -> float:
    """Seconds of the (fused, memory-bound) Adam update of `local_params` parameters,
    with clipping's and the step's `operations` eager operations (`eager_ops.step_ops`)
    where the device pays for each in line."""
    return (memory_time(a.optimizer_bytes_per_param * local_params, gpu, a, 1)
            + operations * gpu.eager_op_s)


def host_times(model: PlanModel, layout: Layout, gpu: GPUSpec, a: Assumptions,
               elem_bytes: int, step_operations: float, forward_reruns: float = 0.0
               ) -> tuple[float, float, float]:
    """Host seconds of one block (forward, `forward_reruns` recomputed forwards and the
    backward) and of the edges (embedding, head, loss) for one microbatch, and of the
    optimizer step's `step_operations` (`eager_ops.step_ops`): partita's eager operations at
    `Assumptions.host_op_s` each. On a GPU the host launches ahead of the kernels, so a
    microbatch takes the longer of the GPU's time and this; a small model or microbatch
    is host-bound. Zeros where it is not modelled: on a CPU the operations run in line
    (`eager_op_s`, counted in the times above), and other implementations' operations
    are not counted. Compiled blocks are charged as eager ones: on one H200 a compiled
    GPT-2 block cost the host as much as the eager block it replaced (docs/planner.md)."""
    if not (a.host_op_s and a.eager_elementwise) or gpu.eager_op_s:
        return 0.0, 0.0, 0.0
    # Explicit scores only where asked for by name: "auto" picks them on CPUs alone.
    fwd, bwd = block_ops(model, layout, elem_bytes, model.config.attention == "explicit")
    edge_fwd, edge_bwd = edge_ops(model, elem_bytes)
    return ((fwd * (1 + forward_reruns) + bwd) * a.host_op_s,
            (edge_fwd + edge_bwd) * a.host_op_s, step_operations * a.host_op_s)
