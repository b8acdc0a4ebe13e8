"""Which blocks and how many parameters one GPU of a pipeline stage holds, before ZeRO.

Pipeline stages own their blocks (an even split, `stage_layers`), the first stage the
embedding and the last the head (and, when tied and pp > 1, a copy of the embedding).
Tensor parallelism divides what it shards (not norms); the vocabulary is cut into
`vocab_rows` per GPU. Parameters come in two ZeRO families: dense ones, sharded over
dp * cp, and expert ones (already divided by ep), sharded over dp * cp / ep.
"""

from __future__ import annotations

import functools

from partita.layout import OVERLAP_OPTIONS, Layout
from partita.planner.assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from partita.planner.memo import memoised
from partita.planner.model_shape import PlanModel


@functools.lru_cache(maxsize=4096)
def stage_layers(n_layers: int, pp: int) -> tuple[int, ...]:
    """Blocks per pipeline stage: an even split, remainder to the stages after the first
    (the first stage holds the most in-flight microbatches and the embedding). Cached:
    a search asks for the same few splits hundreds of thousands of times."""
    base, extra = divmod(n_layers, pp)
    out = [base] * pp
    for i in range(extra):
        out[1 + i % (pp - 1) if pp > 1 else 0] += 1
    return tuple(out)


# The counts read tp, pp, ep and moe_tp; a search counts once per value of these
# (`planner.memo`).
NOT_READ_BY_PARAM_COUNTS = ("dp", "cp", "zero_stage", "offload", "schedule", "virtual_stages",
                            "microbatch_size", "sequence_parallel", "recompute",
                            "recompute_layers", "cp_kind", *OVERLAP_OPTIONS)


@memoised(ignores=NOT_READ_BY_PARAM_COUNTS)
def stage_param_counts(model: PlanModel, layout: Layout, stage: int = 0,
                       assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> dict[str, float]:
    """Parameters one GPU of `stage` holds before ZeRO: dense (sharded by ZeRO over dp*cp,
    tp-sharded and replicated alike) and expert (sharded over dp*cp/ep)."""
    c = model.config
    per_stage = stage_layers(c.n_layers, layout.pp)
    dense, expert = block_param_counts(model, layout, sum(per_stage[:stage]),
                                       per_stage[stage], assumptions)
    vocab = head_weight_elements(model, layout)  # vocab-parallel embedding / head
    first, last = stage == 0, stage == layout.pp - 1
    if first:
        dense += c.embedding_param_count() - c.padded_vocab_size * c.dim + vocab  # + positions
    if last:
        dense += c.head_param_count() - (0 if c.tie_embeddings
                                         else c.padded_vocab_size * c.dim)
        if not c.tie_embeddings or not first:
            dense += vocab  # output projection (a tied copy when on another stage)
    return {"dense": dense, "expert": expert}


def block_param_counts(model: PlanModel, layout: Layout, first_layer: int, layers: int,
                       assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> tuple[float, float]:
    """(dense, expert) parameters one GPU holds of `layers` blocks from `first_layer`."""
    # An MoE model's dense blocks (moe_every > 1) hold no experts. Blocks of one kind are
    # alike: one split per kind, not per block (the search calls this ~10^5 times).
    moe_blocks = model.moe_layers(first_layer, layers)
    dense = expert = 0.0
    for count, moe in ((moe_blocks, True), (layers - moe_blocks, False)):
        if count:
            split = model.block_split(layout.tp, assumptions.whole_kv_replicas, moe=moe,
                                      experts_over_tp=layout.expert_tp > 1)
            dense += count * (split["sharded"] + split["replicated"])
            expert += count * split["expert"] / layout.ep
    return dense, expert


def vocab_rows(model: PlanModel, layout: Layout) -> int:
    """Vocabulary rows on one GPU: the stored vocabulary V (padded to a multiple of
    model.vocab_multiple) is cut as if padded to a multiple of tp, so the first ranks
    hold ceil(V / tp) rows (that second padding is not stored)."""
    return -(-model.config.padded_vocab_size // layout.tp)


def head_weight_elements(model: PlanModel, layout: Layout) -> float:
    """The output projection's (or embedding's) weight on one GPU."""
    return vocab_rows(model, layout) * model.config.dim
