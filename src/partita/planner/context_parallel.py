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
               then their gradient accumulators, which travel with them and come home)
    allgather  forward (c-1) K;  backward (c-1) K + (c-1) K_g   (gather again, then a
               reduce-scatter of the key/value gradients)

K_g is K in the gradients' dtype: the compute dtype (at least float32) where the
implementation accumulates them there (`Assumptions.cp_eager_pieces`, partita's own
kernels), else the activation dtype. Full recomputation repeats the forward's bytes.

Time: the ring posts step i+1's transfer before step i's compute and waits after it,
so each of its c-1 (forward) and c (backward) transfers is hidden up to the compute of
one ring step (`cp_overlap` of it); the all-gather kind waits for its collectives
(Llama 3's choice at small c: one latency instead of c-1). The attention compute itself
is `compute.attention_core` with this rank's queries against the keys they may see.
"""

from __future__ import annotations

from partita.layout import Layout
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
    if layout.cp_kind == "allgather":
        return (c - 1) * k, (c - 1) * (k + k_g)
    return (c - 1) * k, (c - 1) * k + c * k_g


def step_bytes(model: PlanModel, layout: Layout, seq_len: int, layers: int,
               microbatches: int, precision: Precision = MIXED,
               assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Bytes one rank of a stage with `layers` layers sends per optimizer step."""
    fwd, bwd = layer_bytes(model, layout, seq_len, precision, assumptions)
    reruns = 1 if layout.recompute == "full" else 0
    return (fwd * (1 + reruns) + bwd) * layers * microbatches


def buffer_bytes(model: PlanModel, layout: Layout, seq_len: int,
                 precision: Precision = MIXED,
                 assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Transient key/value buffers while one layer's attention runs (its backward, the
    larger): ring: the pair held, the pair arriving, and two gradient accumulators (the
    one travelling and the one being filled); all-gather: the whole sequence's keys and
    values (gathered, then put in sequence order) and their gradients (in sequence order,
    then per owner)."""
    c = layout.cp
    if c == 1:
        return 0.0
    k = kv_shard_bytes(model, layout, seq_len, precision)
    k_g = kv_shard_bytes(model, layout, seq_len, precision,
                         grad_elem_bytes(precision, assumptions))
    if layout.cp_kind == "allgather":
        return 2 * c * (k + k_g)
    return 2 * k + 3 * k_g


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


def attention_pairs_fraction(layout: Layout) -> float:
    """Query-key pairs one rank's eager pieces compute, as a fraction of s x s: 2c+1
    blocks of (s/2c)^2 (the two diagonal blocks are computed whole, then masked)."""
    c = layout.cp
    return 1.0 if c == 1 else (2 * c + 1) / (4 * c * c)
