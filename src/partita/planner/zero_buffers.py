"""ZeRO's flat buffers on one GPU of a pipeline stage, as partita's engine lays them out.

The engine (`partita.zero`) keeps each parameter family in flat buffers: dense
parameters sharded over dp * cp, experts over dp * cp / ep. Under
`Assumptions.flat_buffer_align` every buffer is padded to a multiple of its group x
align elements so that it cuts into equal aligned slices; the padding then counts in
every model state. Stage 3 cuts the buffers into gather units (`zero3_buffers`), whose
sizes the memory breakdown (the largest gathered unit) and the step time (one gather
per unit) both read; stages 0-2 cut gradient buckets instead.
"""

from __future__ import annotations

from partita.layout import OVERLAP_OPTIONS, Layout
from partita.planner.assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from partita.planner.memo import memoised
from partita.planner.model_shape import PlanModel
from partita.planner.precision import MIXED, Precision
from partita.planner.stage_params import stage_layers, stage_param_counts

# The buffers read the degrees and the ZeRO stage; a search lays them out once per value
# of these (`planner.memo`).
NOT_READ_BY_FLAT_BUFFERS = ("offload", "schedule", "virtual_stages", "microbatch_size",
                            "sequence_parallel", "recompute", "recompute_layers", "cp_kind",
                            *OVERLAP_OPTIONS)


@memoised(ignores=NOT_READ_BY_FLAT_BUFFERS)
def zero_param_counts(model: PlanModel, layout: Layout, precision: Precision = MIXED,
                      stage: int = 0, assumptions: Assumptions = DEFAULT_ASSUMPTIONS
                      ) -> dict[str, float]:
    """Parameter elements of `stage` per ZeRO family (dense over dp*cp, expert over
    dp*cp/ep): `stage_param_counts`, or `padded_params` under `flat_buffer_align`."""
    if assumptions.flat_buffer_align:
        return padded_params(model, layout, precision, stage, assumptions)
    return stage_param_counts(model, layout, stage, assumptions)


def padded_params(model: PlanModel, layout: Layout, precision: Precision = MIXED,
                  stage: int = 0, assumptions: Assumptions = DEFAULT_ASSUMPTIONS
                  ) -> dict[str, float]:
    """Parameter elements of `stage` per family with the padding of partita's flat buffers.

    Every buffer is padded to a multiple of its group x align elements (dp*cp for dense
    parameters, dp*cp/ep for experts), so that it cuts into equal aligned slices, and
    every state (parameters, gradients, master weights, moments) is a full or sharded
    copy of the padded buffers. Experts are a family of their own only when ep > 1
    (with ep = 1 they share their block's buffers). Stage 3: the buffers of
    `zero3_buffers`, exact. Stages 0-2 cut gradient buckets of `zero_bucket_bytes`, then
    each into its families: exact for one bucket, else each bucket is taken to waste half
    a slot on average (where they are cut depends on tensor order).
    """
    if layout.zero_stage >= 3:
        b = zero3_buffers(model, layout, precision, stage, assumptions)
        return {"dense": sum(b["units"]) + b["root"], "expert": sum(b["experts"])}
    counts = stage_param_counts(model, layout, stage, assumptions)
    if layout.ep == 1:
        counts = {"dense": counts["dense"] + counts["expert"], "expert": 0.0}
    slots = _slots(layout, assumptions)
    nbytes = precision.param * (counts["dense"] + counts["expert"])
    buckets = max(1, -(-nbytes // assumptions.zero_bucket_bytes))
    if buckets == 1:
        return {k: _pad(n, slots[k]) for k, n in counts.items()}
    return {k: n + buckets * slots[k] / 2 if n else 0.0 for k, n in counts.items()}


def _slots(layout: Layout, assumptions: Assumptions) -> dict[str, int]:
    """Elements a flat buffer of each family is padded to a multiple of."""
    return {"dense": layout.zero_group * assumptions.flat_buffer_align,
            "expert": max(1, layout.zero_group // layout.ep) * assumptions.flat_buffer_align}


def _pad(n: float, unit: int) -> float:
    return -(-n // unit) * unit if n > 0 and unit else max(n, 0.0)


@memoised(ignores=NOT_READ_BY_FLAT_BUFFERS)
def zero3_buffers(model: PlanModel, layout: Layout, precision: Precision = MIXED,
                  stage: int = 0, assumptions: Assumptions = DEFAULT_ASSUMPTIONS
                  ) -> dict:
    """ZeRO-3's flat buffers on one GPU of `stage`, as partita's engine builds them
    (`zero.units.gather_units`, `zero.families`), padded under `flat_buffer_align`:
    "units", the gather units' dense parameters (consecutive blocks up to
    `zero_bucket_bytes`, a dense block and an MoE block each by its own size; with
    ep = 1 a block's experts too); "experts", one unit per MoE block's experts (ep > 1,
    gathered over dp*cp/ep); "unit_experts", the experts gathered beside each unit;
    "root", the rest (embeddings, final norm, head)."""
    c = model.config
    slots = _slots(layout, assumptions) if assumptions.flat_buffer_align else \
        {"dense": 0, "expert": 0}
    per_stage = stage_layers(c.n_layers, layout.pp)
    units: list[float] = []
    beside: list[float] = []
    experts: list[float] = []
    size = in_blocks = 0.0
    for i in range(sum(per_stage[:stage]), sum(per_stage[:stage + 1])):
        split = model.block_split(layout.tp, assumptions.whole_kv_replicas,
                                  moe=not c.moe or c.is_moe_layer(i),
                                  experts_over_tp=layout.expert_tp > 1)
        dense, expert = split["sharded"] + split["replicated"], split["expert"] / layout.ep
        if layout.ep == 1:
            dense, expert = dense + expert, 0.0
        in_blocks += dense + expert
        if not units or (size + dense) * precision.param > assumptions.zero_bucket_bytes:
            units.append(0.0)
            beside.append(0.0)
            size = 0.0
        units[-1] += dense
        size += dense
        if expert:
            experts.append(_pad(expert, slots["expert"]))
            beside[-1] += experts[-1]
    counts = stage_param_counts(model, layout, stage, assumptions)
    root = counts["dense"] + counts["expert"] - in_blocks
    return {"units": [_pad(u, slots["dense"]) for u in units], "experts": experts,
            "unit_experts": beside, "root": _pad(root, slots["dense"])}
