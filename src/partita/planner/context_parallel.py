"""Context parallelism in the planner: the bytes a rank sends, the buffers it holds,
and how much of the transfer its attention compute hides.

With degree c each rank holds 2 of the 2c chunks of every sequence (load-balanced
causal sharding: rank r holds chunks r and 2c-1-r), so its activations are 1/c of one
process's, and attention is the only place where ranks exchange anything. One shard of
keys and values, for b sequences, is

    K = 2 * b * (s/c) * h_kv * d * e   bytes (h_kv kv heads per tensor-parallel rank).

Per layer and microbatch a rank sends (docs/context_parallel.md, measured exactly by
`bench plan-accuracy` and tests/dist/test_context_parallel.py):

    ring       forward (c-1) K;  backward (c-1) K + c K_g   (keys and values once more,
               then their gradient accumulators, which travel with them and come home;
               partita sends each contribution straight to its owner: (c-1) K_g)
    allgather  forward (c-1) K;  backward (c-1) K + (c-1) K_g   (gather again, then a
               reduce-scatter of the key/value gradients)

K_g is K in the gradients' dtype: the compute dtype (at least float32) where the
implementation accumulates them there (`Assumptions.cp_eager_pieces`, partita's own
kernels), else the activation dtype. Full recomputation repeats the forward's bytes of
each recomputed layer (its rerun exchanges the keys and values again); selective
recomputation leaves the context-parallel core alone, so it adds none.

Time: the ring posts step i+1's transfer before step i's compute and waits after it,
so each transfer is hidden up to the compute of one ring step (`cp_overlap` of it); the
all-gather kind waits for its collectives (Llama 3's choice at small c: one latency
instead of c-1). partita's own kernels also run the own pair's blocks beside the
all-gathers and the gradients' last way home (`_partita_exposed`). The attention
compute itself is `compute.attention_core` with this rank's queries against the keys
they may see.
"""

from __future__ import annotations

from partita.layout import Layout
from partita.planner.activation_memory import recomputed_layers
from partita.planner.assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from partita.planner.model_shape import PlanModel
from partita.planner.precision import MIXED, Precision


def kv_shard_bytes(model: PlanModel, layout: Layout, seq_len: int,
                   precision: Precision = MIXED, elem_bytes: float | None = None) -> float:
    """K: one rank's keys and values for one microbatch (kv heads of this tp rank)."""
    c = model.config
    kv_width = -(-c.kv_heads // layout.tp) * c.head_dim
    e = precision.activation if elem_bytes is None else elem_bytes
    return 2 * layout.microbatch_size * seq_len / layout.cp * kv_width * e


def grad_elem_bytes(precision: Precision, assumptions: Assumptions) -> float:
    """Bytes per element of the key/value gradients that travel."""
    e = precision.activation
    return max(e, 4) if assumptions.cp_eager_pieces else e


def layer_bytes(model: PlanModel, layout: Layout, seq_len: int,
                precision: Precision = MIXED,
                assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per layer and microbatch (no recompute)."""
    c = layout.cp
    if c == 1:
        return 0.0, 0.0
    k = kv_shard_bytes(model, layout, seq_len, precision)
    k_g = kv_shard_bytes(model, layout, seq_len, precision,
                         grad_elem_bytes(precision, assumptions))
    if layout.cp_kind == "allgather" or assumptions.cp_eager_pieces:
        return (c - 1) * k, (c - 1) * (k + k_g)
    return (c - 1) * k, (c - 1) * k + c * k_g


def step_bytes(model: PlanModel, layout: Layout, seq_len: int, layers: int,
               microbatches: int, precision: Precision = MIXED,
               assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Bytes one rank of a stage with `layers` layers sends per optimizer step. Full
    recompute reruns the forward of the first `recompute_layers` (0: all) in backward,
    exchanges included; selective reruns no context-parallel core."""
    fwd, bwd = layer_bytes(model, layout, seq_len, precision, assumptions)
    reruns = recomputed_layers(layout, layers) if layout.recompute == "full" else 0
    if layout.schedule == "zb-h1" and layout.pp > 1:
        reruns *= 2  # a split backward reruns in I and again in W
    return ((fwd + bwd) * layers + fwd * reruns) * microbatches


def buffer_bytes(model: PlanModel, layout: Layout, seq_len: int,
                 precision: Precision = MIXED,
                 assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Transient key/value buffers while one layer's attention runs (its backward, the
    larger): ring: the pair held, the pair arriving, and gradients (partita: the own
    pair's, the contribution being computed, one leaving and one arriving; else two
    accumulators, the one travelling and the one being filled); all-gather: the whole
    sequence's keys and values and their gradients, twice each (partita: gathered and
    the pieces' copies, the gradients per owner and the reduce-scatter's scratch)."""
    c = layout.cp
    if c == 1:
        return 0.0
    k = kv_shard_bytes(model, layout, seq_len, precision)
    k_g = kv_shard_bytes(model, layout, seq_len, precision,
                         grad_elem_bytes(precision, assumptions))
    if layout.cp_kind == "allgather":
        return 2 * c * (k + k_g)
    return 2 * k + (4 if assumptions.cp_eager_pieces else 3) * k_g


def exposed_time(model: PlanModel, layout: Layout, seq_len: int, core_fwd: float,
                 core_bwd: float, link: tuple[float, float], efficiency: float,
                 precision: Precision = MIXED,
                 assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's cp communication left on the critical
    path, given the attention core's compute time each way and the group's link."""
    c = layout.cp
    if c == 1:
        return 0.0, 0.0
    bw, alpha = link
    k = kv_shard_bytes(model, layout, seq_len, precision)
    k_g = kv_shard_bytes(model, layout, seq_len, precision,
                         grad_elem_bytes(precision, assumptions))
    if assumptions.cp_eager_pieces:
        return _partita_exposed(layout, k, k_g, core_fwd, core_bwd, link, efficiency,
                                assumptions)
    if layout.cp_kind == "allgather":
        # Collectives wait: an all-gather forward, an all-gather + reduce-scatter back.
        fwd = (c - 1) * k / (bw * efficiency) + (c - 1) * alpha
        bwd = (c - 1) * (k + k_g) / (bw * efficiency) + 2 * (c - 1) * alpha
        return fwd, bwd
    # Ring: 2c+1 equal pieces per rank, 3 in the first step and 2 in each other; step
    # i's transfer runs beside step i's pieces.
    per_step_fwd = 2 * core_fwd / (2 * c + 1)
    per_step_bwd = 2 * core_bwd / (2 * c + 1)
    hide = assumptions.cp_overlap
    hop_fwd = k / (bw * efficiency) + alpha
    hop_bwd = (k + k_g) / (bw * efficiency) + alpha
    fwd = (c - 1) * max(0.0, hop_fwd - hide * per_step_fwd)
    bwd = (c - 1) * max(0.0, hop_bwd - hide * per_step_bwd)
    bwd += k_g / (bw * efficiency) + alpha  # the accumulators' last hop home: waited for
    return fwd, bwd


def _partita_exposed(layout: Layout, k: float, k_g: float, core_fwd: float,
                     core_bwd: float, link: tuple[float, float], efficiency: float,
                     assumptions: Assumptions) -> tuple[float, float]:
    """partita's kernels (context_parallel/ring.py, allgather.py). Per rank, the own
    pair's causal block is one c-th of the attention and each other pair's visible part
    another. Ring: each hop runs beside one step; in backward the gradients' last way
    home runs beside the own pair's diagonal blocks (half its block). All-gather: the
    forward gather runs beside the own pair, the backward gather beside the own pair's
    full block and the reduce-scatter beside its diagonal blocks."""
    c = layout.cp
    bw, alpha = link
    hide = assumptions.cp_overlap
    step_fwd, step_bwd = core_fwd / c, core_bwd / c

    def left(seconds: float, beside: float) -> float:
        return max(0.0, seconds - hide * beside)

    kv_s = (c - 1) * k / (bw * efficiency)
    grad_s = (c - 1) * k_g / (bw * efficiency)
    if layout.cp_kind == "allgather":
        fwd = left(kv_s + (c - 1) * alpha, step_fwd)
        bwd = (left(kv_s + (c - 1) * alpha, step_bwd / 2)
               + left(grad_s + (c - 1) * alpha, step_bwd / 2))
        return fwd, bwd
    hop_k, hop_g = k / (bw * efficiency) + alpha, k_g / (bw * efficiency) + alpha
    fwd = (c - 1) * left(hop_k, step_fwd)
    # Step i's keys hop and step i-1's gradients run beside step i; the first keys hop
    # beside the own pair's full block, the last gradients beside its diagonal blocks.
    bwd = (left(hop_k, step_bwd / 2) + (c - 2) * left(hop_k + hop_g, step_bwd)
           + left(hop_g, step_bwd / 2))
    return fwd, bwd


def attention_pairs_fraction(layout: Layout) -> float:
    """Query-key pairs one rank's pieces compute without a fused kernel, as a fraction
    of s x s: the own pair's 2n x 2n block whole (then masked) and n x 2n of each other
    pair's, n = s/2c."""
    c = layout.cp
    return 1.0 if c == 1 else (2 * c + 2) / (4 * c * c)
