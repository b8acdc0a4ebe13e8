"""Host memory of disk offload (ZeRO-Infinity), as partita's engine allocates it.

The engine (`partita.memory.disk`) steps each bucket's owned slice in sub-groups
through `SETS` buffer sets. A set holds a sub-group's master weights and both moments
in the master dtype, and also, when the gradients live on a GPU, a staged copy of its
gradient (on a CPU the update reads them in place) and, when the parameter shards are
on disk too, the updated parameters. The sub-group is the largest that fits the host
budget (`subgroup_elements`), but no larger than the largest owned slice of a bucket
needs: a model whose buckets are small holds far less than the budget. Beside the
sets: the block's alignment slack and, when the gradients are of another dtype than
the master weights, the update's cast scratch (at most `CPU_CHUNK` elements).

The engine's constants are repeated here (the planner imports no torch); a unit test
checks them and `disk_buffer_bytes` against `DiskOptimizer.buffer_bytes`.
"""

from __future__ import annotations

from partita.layout import Layout
from partita.planner.assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from partita.planner.model_shape import PlanModel
from partita.planner.precision import MIXED, Precision
from partita.planner.stage_params import head_weight_elements, stage_layers
from partita.planner.zero_buffers import zero3_buffers, zero_param_counts

SETS = 3  # partita.memory.disk.SETS: read ahead, update, write back
ALIGN = 4096  # partita.memory.disk.ALIGN: bytes
STATES = 3  # master, exp_avg, exp_avg_sq
CPU_CHUNK = 1 << 18  # partita.optim.adamw.CPU_CHUNK: the cast scratch's most elements


def master_bytes(precision: Precision) -> int:
    """The master dtype's bytes: fp32 training keeps a master copy on the host too."""
    return precision.master or precision.param


def subgroup_elements(budget_bytes: float, precision: Precision, stage_grads: bool,
                      params_on_disk: bool) -> int:
    """`partita.memory.disk.subgroup_elements`: the largest sub-group whose buffer sets
    (and cast scratch) fit in `budget_bytes`, a whole number of ALIGN bytes of each
    state (0 where not even that fits; the engine then refuses the budget)."""
    m = master_bytes(precision)
    per = SETS * (STATES * m + stage_grads * precision.grad
                  + (precision.param if params_on_disk else 0))
    if precision.grad != m:
        per += m
    granule = ALIGN // m
    return max(0, int((budget_bytes - ALIGN) // per) // granule * granule)


def largest_owned_bucket(model: PlanModel, layout: Layout, precision: Precision = MIXED,
                         stage: int = 0,
                         assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Elements of the largest owned slice of one ZeRO bucket on one GPU of `stage`.

    ZeRO-3: the buckets are the gather units, the experts' units and the root group
    (`zero3_buffers`), exact. Stages 0-2: one bucket per family when the stage's
    parameters fit in `zero_bucket_bytes` (exact); else buckets of about that size, or
    of the largest tensor where it is larger (a tensor is never split), an upper bound
    (the engine caps the first and last buckets on a GPU)."""
    group = {"dense": layout.zero_group, "expert": max(1, layout.zero_group // layout.ep)}
    if layout.zero_stage < 1:
        group = {"dense": 1, "expert": 1}
    if layout.zero_stage >= 3:
        b = zero3_buffers(model, layout, precision, stage, assumptions)
        dense = max([*b["units"], b["root"]], default=0.0)
        expert = max(b["experts"], default=0.0)
        return max(dense / group["dense"], expert / group["expert"])
    counts = zero_param_counts(model, layout, precision, stage, assumptions)
    if layout.ep == 1:
        counts = {"dense": counts["dense"] + counts["expert"], "expert": 0.0}
    one_bucket = precision.param * sum(counts.values()) <= assumptions.zero_bucket_bytes
    if not one_bucket:
        tensor = _largest_tensor(model, layout, stage)
        if layout.ep == 1:
            tensor = {"dense": max(tensor.values()), "expert": 0.0}
        cap = assumptions.zero_bucket_bytes / precision.param
        align = assumptions.flat_buffer_align
        for k, n in counts.items():
            # A bucket is padded to a multiple of its group x align elements.
            slot = group[k] * align or 1
            counts[k] = min(n, -(-max(cap, tensor[k]) // slot) * slot)
    return max(n / group[k] for k, n in counts.items())


def _largest_tensor(model: PlanModel, layout: Layout, stage: int) -> dict[str, float]:
    """The largest single parameter of each family on one GPU of `stage`: the
    vocabulary's rows on the first and last stages, a block's widest projection, an
    MoE block's stacked experts (one tensor per projection)."""
    c, tp = model.config, layout.tp
    per_stage = stage_layers(c.n_layers, layout.pp)
    first = sum(per_stage[:stage])
    dense = max(c.dim * c.dim, c.dim * c.ffn_hidden) / tp if per_stage[stage] else 0.0
    expert = 0.0
    if model.moe_layers(first, per_stage[stage]):
        split = 1 if layout.expert_tp > 1 else tp
        expert = model.moe.num_experts * model.expert_ffn * c.dim / layout.ep / split
    if stage == 0 or stage == layout.pp - 1:
        dense = max(dense, head_weight_elements(model, layout))
    return {"dense": dense, "expert": expert}


def disk_buffer_bytes(model: PlanModel, layout: Layout, precision: Precision = MIXED,
                      stage: int = 0,
                      assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Host bytes the disk-offload engine of one GPU of `stage` allocates: `buffer_bytes`
    for its largest owned bucket, its budget and its device (on a CPU no gradient is
    staged)."""
    largest = largest_owned_bucket(model, layout, precision, stage, assumptions)
    return buffer_bytes(largest, assumptions.disk_host_budget_bytes, precision,
                        stage_grads=assumptions.device_type != "cpu",
                        params_on_disk="+params" in layout.offload)


def buffer_bytes(largest_bucket: float, budget_bytes: float, precision: Precision,
                 stage_grads: bool, params_on_disk: bool) -> float:
    """`DiskOptimizer.buffer_bytes`: SETS buffer sets of one sub-group each, the
    sub-group the smaller of what the budget allows and the largest owned bucket
    (rounded up to whole ALIGN bytes), with the block's alignment slack and the cast
    scratch."""
    m = master_bytes(precision)
    granule = ALIGN // m
    n = subgroup_elements(budget_bytes, precision, stage_grads, params_on_disk)
    n = min(n, -(-max(largest_bucket, 1) // granule) * granule)
    per_set = (STATES * m + stage_grads * precision.grad
               + (precision.param if params_on_disk else 0))
    scratch = min(n, CPU_CHUNK) * m if precision.grad != m else 0
    return SETS * n * per_set + ALIGN + scratch
