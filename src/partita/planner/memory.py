"""Per-GPU memory of a layout, as named terms that tests compare with measured bytes.

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020) with the
bytes per parameter of a `Precision` (default 2 + 2 + 4 + 8): stage 0 keeps all four
states whole, stage 1 shards master weights and optimizer moments over the ZeRO group,
stage 2 also gradients, stage 3 also parameters. The ZeRO group is dp * cp for dense
parameters and dp * cp / ep for expert parameters. `stage_params` counts what a stage
holds; `zero_buffers` lays it out in ZeRO's padded flat buffers.

A stage's peak adds its activations (layers x microbatches held by the schedule) and
temporary buffers; `memory_breakdown` returns them all as one dict of named bytes.
"""

from __future__ import annotations

from dataclasses import replace

from partita.layout import OVERLAP_OPTIONS, Layout
from partita.planner.activation_memory import (
    inflight_chunks,
    layer_activation_bytes,
    layer_activation_terms,
    layer_input_bytes,
    norm_bytes,
    norm_weight_pass_bytes,
    recompute_bias_bytes,
    recompute_transient_bytes,
    recomputed_layers,
    weight_pass_terms,
)
from partita.planner.assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from partita.planner.context_parallel import buffer_bytes as cp_buffer_bytes
from partita.planner.disk_buffers import disk_buffer_bytes
from partita.planner.memo import memoised
from partita.planner.model_shape import PlanModel
from partita.planner.precision import MIXED, Precision
from partita.planner.schedule_peaks import (
    interleaved_peak,
    zero_bubble_after_forward,
    zero_bubble_peak,
)
from partita.planner.stage_params import (
    block_param_counts,
    head_weight_elements,
    stage_layers,
    vocab_rows,
)
from partita.planner.zero_buffers import (
    NOT_READ_BY_FLAT_BUFFERS,
    zero3_buffers,
    zero_param_counts,
)

MODEL_STATE_TERMS = ("parameters", "gradients", "master_weights", "optimizer_states")
# What each part of a stage's bytes does not read (`planner.memo`: a search computes it
# once per value of the rest). What ZeRO holds (model states, its gathered units and
# gradient buckets) reads the degrees, ZeRO and offload only; what the microbatches
# hold (activations, pipeline and context-parallel buffers, the loss) reads all but
# ZeRO, offload, the experts' split over ep and the overlap options.
NOT_READ_BY_STATES = ("schedule", "virtual_stages", "microbatch_size", "sequence_parallel",
                      "recompute", "recompute_layers", "cp_kind", *OVERLAP_OPTIONS)
NOT_READ_BY_ACTIVATIONS = ("zero_stage", "offload", "ep", *OVERLAP_OPTIONS)


def zero_state_bytes(num_params: float, zero_stage: int, shard_degree: int,
                     precision: Precision = MIXED, offload: str = "none") -> dict[str, float]:
    """The ZeRO paper's accounting for `num_params` parameters sharded over `shard_degree`
    ranks: stage 1 shards master weights and optimizer states, stage 2 also gradients,
    stage 3 also parameters. Offloaded master weights and optimizer states leave the GPU.
    (7.5e9 parameters on 64 GPUs, mixed precision: 120 / 31.4 / 16.6 / 1.88 GB.)"""
    z, g = zero_stage, shard_degree
    on_gpu = offload == "none"
    params_on_gpu = "+params" not in offload  # ZeRO-3 shards at rest on the host (or disk)
    return {
        "parameters": params_on_gpu * precision.param * num_params / (g if z >= 3 else 1),
        "gradients": precision.grad * num_params / (g if z >= 2 else 1),
        "master_weights": on_gpu * precision.master * num_params / (g if z >= 1 else 1),
        "optimizer_states": on_gpu * precision.optimizer * num_params / (g if z >= 1 else 1),
    }


@memoised(ignores=NOT_READ_BY_STATES)
def model_state_bytes(model: PlanModel, layout: Layout, precision: Precision = MIXED,
                      stage: int = 0,
                      assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> dict[str, float]:
    """Bytes of parameters, gradients, fp32 master weights and optimizer states on one
    GPU of `stage` (on the GPU: offloaded states are in `host_state_bytes`).

    With `assumptions.flat_buffer_align` the parameters are counted as partita's ZeRO
    engine lays them out, padding included (see `zero_buffers.padded_params`)."""
    counts = zero_param_counts(model, layout, precision, stage, assumptions)
    groups = {"dense": layout.zero_group, "expert": max(1, layout.zero_group // layout.ep)}
    out = dict.fromkeys(MODEL_STATE_TERMS, 0.0)
    for kind, n in counts.items():
        for term, value in zero_state_bytes(n, layout.zero_stage, groups[kind], precision,
                                            layout.offload).items():
            out[term] += value
    return out


def host_state_bytes(model: PlanModel, layout: Layout, precision: Precision = MIXED,
                     stage: int = 0,
                     assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """CPU memory one GPU's offloaded states take: per element of its owned slice, the
    master copy (one is kept even for fp32 parameters: the update runs on the host),
    both moments, a staging copy of the gradient and, under "optimizer+params", the
    parameter shard (partita.memory.offload). Padded like `model_state_bytes`. Disk
    offload: the engine's buffer sets, sized by the largest bucket or the budget,
    whichever is smaller (`planner.disk_buffers`)."""
    if layout.offload == "none":
        return 0.0
    if layout.offload.endswith("+disk"):
        return disk_buffer_bytes(model, layout, precision, stage, assumptions)
    owned = owned_elements(model, layout, precision, stage, assumptions)
    per = (precision.master or precision.param) + precision.optimizer + precision.grad
    if layout.offload == "optimizer+params":
        per += precision.param
    return per * owned


def disk_state_bytes(model: PlanModel, layout: Layout, precision: Precision = MIXED,
                     stage: int = 0,
                     assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Disk one GPU's offloaded states take: master weights and both moments of its
    owned slice, twice (a step reads one generation and writes the other)."""
    if not layout.offload.endswith("+disk"):
        return 0.0
    per = 2 * ((precision.master or precision.param) + precision.optimizer)
    if "+params" in layout.offload:
        per += precision.param  # the shard, one file rewritten in place
    return per * owned_elements(model, layout, precision, stage, assumptions)


@memoised(ignores=NOT_READ_BY_FLAT_BUFFERS)
def owned_elements(model: PlanModel, layout: Layout, precision: Precision = MIXED,
                   stage: int = 0, assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Parameter elements whose optimizer state one GPU of `stage` keeps (padded like
    `model_state_bytes` under `flat_buffer_align`)."""
    counts = zero_param_counts(model, layout, precision, stage, assumptions)
    groups = {"dense": layout.zero_group, "expert": max(1, layout.zero_group // layout.ep)}
    return sum(n / (groups[k] if layout.zero_stage >= 1 else 1) for k, n in counts.items())


def activation_bytes(model: PlanModel, layout: Layout, seq_len: int, num_microbatches: int,
                     stage: int = 0, precision: Precision = MIXED,
                     assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Activations saved for backward on one GPU of `stage` at its peak: per-layer bytes
    x the stage's layers x the microbatches the schedule holds in flight, plus what the
    last stage keeps for the loss and, under full recompute, one layer's working set.
    ZB-H1 is walked action by action (`zero_bubble_peak`): a microbatch waiting for its
    deferred W holds only what W reads."""
    counts = stage_layers(model.config.n_layers, layout.pp)
    layers = counts[stage]
    plain = _without_recompute(layout)
    k = recomputed_layers(layout, layers)
    # An MoE model's layers: its MoE blocks and (moe_every > 1) its dense ones, averaged.
    n_moe = model.moe_layers(sum(counts[:stage]), layers)

    def per_layer(lay: Layout) -> float:
        moe = layer_activation_bytes(model, lay, seq_len, precision, assumptions)
        if n_moe == layers:
            return moe
        dense = layer_activation_bytes(model.dense_blocks(), lay, seq_len, precision,
                                       assumptions)
        return (n_moe * moe + (layers - n_moe) * dense) / max(layers, 1)

    per_none = per_layer(plain)
    # The first k layers keep what recompute keeps, the rest everything.
    stage_bytes = k * per_layer(layout) + (layers - k) * per_none
    if k:
        stage_bytes += recompute_bias_bytes(model, layout, seq_len, precision, assumptions)
    tokens = microbatch_tokens(layout, seq_len)
    ids = assumptions.token_id_bytes / 2 * tokens
    first, last = stage == 0, stage == layout.pp - 1
    # Loss side of the last stage: logits, the head's input, the targets and what the
    # loss keeps per token besides them.
    loss_side = (logits_bytes(model, layout, seq_len, assumptions)
                 + head_input_bytes(model, layout, seq_len, precision, assumptions) + ids
                 + assumptions.loss_token_bytes * tokens)
    whole = stage_bytes + (ids if first else 0.0) + (loss_side if last else 0.0)
    rerun = recompute_transient_bytes(model, layout, seq_len, precision, assumptions) if k else 0.0
    if layout.schedule == "zb-h1" and layout.pp > 1:
        deferred = _deferred_weight_pass_bytes(model, layout, seq_len, precision,
                                               assumptions, sum(counts[:stage]), layers,
                                               first, last)
        total = zero_bubble_peak(layout.pp, num_microbatches, stage, whole, deferred)
        if rerun:  # I keeps the microbatch's graph whole while a layer reruns
            total = max(total, zero_bubble_after_forward(layout.pp, num_microbatches,
                                                          stage, whole, deferred) + rerun)
        if last:  # the step's sum of head weight gradients, formed right after each I
            total += precision.grad * head_weight_elements(model, layout)
        return total
    interleaved = layout.schedule == "interleaved-1f1b" and layout.pp > 1
    if interleaved and 0 < k < layers:
        # The rank's first k blocks rerun: its first chunks recompute, its last do not,
        # and the schedule holds more microbatches of its first chunks than of its last.
        return interleaved_peak(layout, num_microbatches, stage, layers, k,
                                 per_layer(layout), per_none, rerun, loss_side, ids,
                                 recompute_bias_bytes(model, layout, seq_len, precision,
                                                      assumptions),
                                 _released_before_rerun(model, layout, seq_len, precision,
                                                        assumptions))
    chunks = inflight_chunks(layout, stage, num_microbatches)
    total = stage_bytes * chunks / layout.virtual_stages
    if first:
        total += ids * chunks / layout.virtual_stages  # token ids of the embedding lookup
    if last:
        # 1F1B runs each microbatch's backward right after its loss; GPipe holds all.
        total += (num_microbatches if layout.schedule == "gpipe" else 1) * loss_side
    if rerun:
        # A whole backward (B) reaches the last rerun layer after the loss and the later
        # layers have released what they saved; then the rerun adds its working set.
        at_b = (total - (loss_side if last else 0.0)
                - (layers - k) * per_none / layout.virtual_stages
                - _released_before_rerun(model, layout, seq_len, precision, assumptions)
                + rerun)
        # Under GPipe and 1F1B every stage but the first runs its last backward split
        # (I then W, see pipeline.schedules): I keeps that microbatch's graph whole while
        # it reruns. The interleaved schedule splits none.
        split = layout.pp > 1 and stage > 0 and not interleaved
        at_split = whole + rerun if split else 0.0
        total = max(total, at_b, at_split)
    return total


# In a search, one copy per layout that differs in more than recomputation.
@memoised(ignores=("recompute", "recompute_layers"))
def _without_recompute(layout: Layout) -> Layout:
    """`layout` with no recomputation."""
    return layout.with_(recompute="none", recompute_layers=0)


def _released_before_rerun(model: PlanModel, layout: Layout, seq_len: int,
                           precision: Precision, assumptions: Assumptions) -> float:
    """Selective recompute reruns the attention core halfway through its layer's
    backward: the MLP's tensors, the output projection's input and the second norm's
    have been released by then. (Full recompute reruns first: nothing released.)"""
    if layout.recompute != "selective":
        return 0.0
    t = layer_activation_terms(model, layout, seq_len, precision, assumptions)
    return (t["mlp_hidden"] + t["mlp_input"] + t["attention_output"] + t["norm_inputs"] / 2
            + t["dropout_masks"])


def _deferred_weight_pass_bytes(model: PlanModel, layout: Layout, seq_len: int,
                                precision: Precision, assumptions: Assumptions,
                                first_layer: int, layers: int, first: bool,
                                last: bool) -> float:
    """What one microbatch of a stage holds between I and W (`weight_pass_terms` per
    layer; stage 0 adds the embedding's token ids and the gradient at its output, the
    last stage the final norm's input and output gradient). The output projection's
    weight gradient is formed right after I (`PipelineRunner._early_weight_params`),
    which releases its input and the logits' gradient there; the stage holds their sum
    over the step instead (`activation_bytes`)."""
    e, tokens = precision.activation, microbatch_tokens(layout, seq_len)
    h, sp_div = model.config.dim, layout.tp if layout.sequence_parallel else 1
    ids = assumptions.token_id_bytes / 2 * tokens
    k = recomputed_layers(layout, layers)
    plain = _without_recompute(layout)
    recomputed = k * sum(weight_pass_terms(model, layout, seq_len, precision,
                                           assumptions).values())
    if assumptions.compiled_blocks:
        # Compiled blocks: I computed their weight gradients (parameter-sized, in the
        # parameters' dtype) and released everything they saved; only fully recomputed
        # ones (the first k) rerun from W and hold what eager does (`pipeline_times`).
        # (An MoE block's experts, which run eagerly between its compiled pieces, are
        # counted alike: not measured.)
        rerun_k = k if layout.recompute == "full" else 0
        dense, expert = block_param_counts(model, layout, first_layer + rerun_k,
                                           layers - rerun_k, assumptions)
        total = (recomputed if rerun_k else 0.0) + precision.param * (dense + expert)
    else:
        total = recomputed + (layers - k) * sum(weight_pass_terms(
            model, plain, seq_len, precision, assumptions).values())
    if first:
        total += ids + e * tokens * h / sp_div
    if last:
        norm = norm_weight_pass_bytes(model, tokens / sp_div, precision, assumptions)
        total += norm + e * tokens * h / sp_div  # the norm's input and output gradient
    return total


def head_input_bytes(model: PlanModel, layout: Layout, seq_len: int,
                     precision: Precision = MIXED,
                     assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """The final norm and the output projection's input. Under the GPU defaults one
    tensor of width h stands for both (a fused norm); with eager norms the norm's own
    tensors plus the head's input (gathered along the sequence under sp by partita)."""
    if assumptions.norm_kernel == "fused":
        return layer_input_bytes(model, layout, seq_len, precision)
    if assumptions.norm_kernel == "compiled" and not assumptions.compiled_model:
        assumptions = replace(assumptions, norm_kernel="eager")  # outside the blocks
    tokens = microbatch_tokens(layout, seq_len)
    sp_div = layout.tp if layout.sequence_parallel else 1
    if assumptions.compiled_model and layout.recompute == "full":
        # With the blocks rerun in backward the compiler reruns the final norm too, from
        # its input and rsqrt, and keeps no head input (measured, `planner.compiled`).
        return norm_bytes(model, tokens / sp_div, precision, assumptions)
    in_div = 1 if assumptions.sp_saves_gathered_input else sp_div
    return (norm_bytes(model, tokens / sp_div, precision, assumptions)
            + precision.activation * tokens * model.config.dim / in_div)


def microbatch_tokens(layout: Layout, seq_len: int) -> float:
    """Tokens of one microbatch on one GPU (its share of the sequence under cp)."""
    return seq_len / layout.cp * layout.microbatch_size


def logit_elements(model: PlanModel, layout: Layout, seq_len: int) -> float:
    """One microbatch's logits on one GPU: tokens x this rank's vocabulary rows (the
    vocabulary padded to a multiple of tp)."""
    return microbatch_tokens(layout, seq_len) * vocab_rows(model, layout)


def logits_bytes(model: PlanModel, layout: Layout, seq_len: int,
                 assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Logits of one microbatch with their fp32 softmax and gradient (vocab-parallel)."""
    return assumptions.logits_bytes_per_element * logit_elements(model, layout, seq_len)


def loss_transient_bytes(model: PlanModel, layout: Layout, seq_len: int,
                         precision: Precision = MIXED,
                         assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Bytes the last stage holds only while one microbatch's loss runs, beyond the fp32
    tensor the loss saves (`logits_bytes`): partita's loss (`partita.loss`) works in
    that tensor in place, beside which live only the logits themselves in forward and
    their gradient in the logits' dtype in backward, one element per logit either way
    (measured op by op in tests/unit/test_planner_memory.py). Megatron-style fused losses
    count none of this (`loss_transients` off)."""
    if not assumptions.loss_transients:
        return 0.0
    return precision.activation * logit_elements(model, layout, seq_len)


def comm_buffer_bytes(model: PlanModel, layout: Layout, seq_len: int,
                      precision: Precision = MIXED, stage: int = 0,
                      assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> dict[str, float]:
    """Temporary communication buffers: gathered ZeRO-3 units (with prefetch) and the
    unit's full gradients before reduce-scatter, gradient buckets, pipeline send/recv,
    context-parallel key/value buffers."""
    zero3, buckets = zero_buffer_bytes(model, layout, precision, stage, assumptions)
    p2p, kv = microbatch_buffer_bytes(model, layout, seq_len, precision, assumptions)
    return {"zero3_gathered": zero3, "grad_buckets": buckets, "pipeline_p2p": p2p,
            "context_parallel_kv": kv}


def zero_buffer_bytes(model: PlanModel, layout: Layout, precision: Precision = MIXED,
                      stage: int = 0, assumptions: Assumptions = DEFAULT_ASSUMPTIONS
                      ) -> tuple[float, float]:
    """ZeRO's buffers (`comm_buffer_bytes`): (gathered ZeRO-3 units with the unit's full
    gradients, gradient buckets)."""
    c = model.config
    if layout.zero_stage >= 3 and layout.zero_group > 1:
        # The largest gather unit with its blocks' experts (ep > 1: gathered right after).
        b = zero3_buffers(model, layout, precision, stage, assumptions)
        sizes = [u + e for u, e in zip(b["units"], b["unit_experts"])]
        unit = max(sizes, default=0.0)
        if stage == 0 or stage == layout.pp - 1:
            unit = max(unit, c.padded_vocab_size * c.dim / layout.tp)
        # In forward the unit computing and those prefetched; when backward starts, the
        # kept units (still gathered from forward) and those prefetched before them
        # (none once every unit is kept).
        k, ahead = min(assumptions.zero3_kept_units, len(sizes)), assumptions.zero3_prefetch_depth
        kept = sum(sizes[len(sizes) - k:])
        gathered = max((1 + ahead) * unit, kept + min(ahead, len(sizes) - k) * unit)
        return precision.param * gathered + precision.grad * unit, 0.0
    if layout.zero_group > 1:
        grads = model_state_bytes(model, layout, precision, stage, assumptions)["gradients"]
        return 0.0, min(assumptions.grad_bucket_bytes, grads)
    return 0.0, 0.0


def microbatch_buffer_bytes(model: PlanModel, layout: Layout, seq_len: int,
                            precision: Precision = MIXED,
                            assumptions: Assumptions = DEFAULT_ASSUMPTIONS
                            ) -> tuple[float, float]:
    """A microbatch's buffers (`comm_buffer_bytes`): (pipeline send/recv,
    context-parallel key/value buffers)."""
    p2p = 2 * layer_input_bytes(model, layout, seq_len, precision) if layout.pp > 1 else 0.0
    return p2p, cp_buffer_bytes(model, layout, seq_len, precision, assumptions)


def memory_breakdown(model: PlanModel, layout: Layout, seq_len: int, num_microbatches: int,
                     stage: int = 0, precision: Precision = MIXED,
                     assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
                     runtime_reserved: float = 0.0) -> dict[str, float]:
    """Every byte on one GPU of `stage`: model states, activations, communication
    buffers, the loss's transients (last stage), the device's runtime reserve
    (`GPUSpec.runtime_reserved_bytes`) and the fragmentation allowance, and their
    `total`."""
    return _breakdown(_held_by_zero(model, layout, precision, stage, assumptions),
                      _held_by_microbatches(model, layout, seq_len, num_microbatches, stage,
                                            precision, assumptions),
                      assumptions.fragmentation, runtime_reserved)


# A stage's bytes in two parts, each read by a memoised lookup in a search (`planner.memo`):
# what ZeRO holds, ((state, bytes) pairs, ZeRO's two buffers), and what the microbatches
# hold (activations, the pipeline's and context parallelism's buffers, the loss's
# transients). Tuples: what is memoised is shared, so it must not change.
ZeroPart = tuple[tuple[tuple[str, float], ...], tuple[float, float]]
MicrobatchPart = tuple[float, tuple[float, float], float]


def _held_by_zero(model: PlanModel, layout: Layout, precision: Precision, stage: int,
                  assumptions: Assumptions) -> ZeroPart:
    states = model_state_bytes(model, layout, precision, stage, assumptions)
    return (tuple(states.items()),
            zero_buffer_bytes(model, layout, precision, stage, assumptions))


def _held_by_microbatches(model: PlanModel, layout: Layout, seq_len: int,
                          num_microbatches: int, stage: int, precision: Precision,
                          assumptions: Assumptions) -> MicrobatchPart:
    activations = activation_bytes(model, layout, seq_len, num_microbatches, stage,
                                   precision, assumptions)
    buffers = microbatch_buffer_bytes(model, layout, seq_len, precision, assumptions)
    # Beside the saved activations: the loss runs while its microbatch's are all held.
    loss = (loss_transient_bytes(model, layout, seq_len, precision, assumptions)
            if stage == layout.pp - 1 else 0.0)
    return activations, buffers, loss


def _breakdown(zero: ZeroPart, microbatches: MicrobatchPart, fragmentation: float,
               runtime_reserved: float) -> dict[str, float]:
    """`memory_breakdown` from its two parts."""
    (states, (zero3, buckets)), (activations, (p2p, kv), loss) = zero, microbatches
    out = dict(states)
    out["activations"] = activations
    # The buffers in `comm_buffer_bytes`' order, summed as it is.
    out["comm_buffers"] = sum((zero3, buckets, p2p, kv))
    out["loss_transients"] = loss
    subtotal = sum(out.values())
    out["runtime_reserved"] = runtime_reserved
    out["fragmentation"] = fragmentation * subtotal
    out["total"] = subtotal + out["runtime_reserved"] + out["fragmentation"]
    return out


def peak_stages(pp: int, schedule: str = "1f1b") -> list[int]:
    """Stages that can hold the peak: the first (most microbatches in flight, embedding),
    the second (most layers), the last (head and logits); under ZB-H1 also the one
    before the last (the most microbatches waiting for W, which can cost more than
    running ones)."""
    zb = {pp - 2} if schedule == "zb-h1" and pp > 2 else set()
    return sorted({0, min(1, pp - 1), pp - 1} | zb)


def peak_memory(model: PlanModel, layout: Layout, seq_len: int, num_microbatches: int,
                precision: Precision = MIXED, assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
                runtime_reserved: float = 0.0) -> tuple[int, dict[str, float]]:
    """(stage, breakdown) of the pipeline stage with the largest total."""
    # `memory_breakdown` of each stage that can peak, from two memoised lookups per
    # layout rather than two per stage (the search's most frequent question).
    zero = dict(_zero_parts(model, layout, precision, assumptions))
    best: tuple[int, dict[str, float]] | None = None
    for stage, microbatches in _microbatch_parts(model, layout, seq_len, num_microbatches,
                                                 precision, assumptions):
        b = _breakdown(zero[stage], microbatches, assumptions.fragmentation, runtime_reserved)
        if best is None or b["total"] > best[1]["total"]:
            best = (stage, b)
    assert best is not None
    return best


@memoised(ignores=NOT_READ_BY_STATES)
def _zero_parts(model: PlanModel, layout: Layout, precision: Precision,
                assumptions: Assumptions) -> tuple[tuple[int, ZeroPart], ...]:
    """(stage, what ZeRO holds there) for each stage that can peak under any schedule
    (ZB-H1's are a superset of the others'), in `peak_stages` order."""
    return tuple((stage, _held_by_zero(model, layout, precision, stage, assumptions))
                 for stage in peak_stages(layout.pp, "zb-h1"))


@memoised(ignores=NOT_READ_BY_ACTIVATIONS)
def _microbatch_parts(model: PlanModel, layout: Layout, seq_len: int, num_microbatches: int,
                      precision: Precision, assumptions: Assumptions
                      ) -> tuple[tuple[int, MicrobatchPart], ...]:
    """(stage, what the microbatches hold there) for each stage that can peak under the
    layout's schedule, in `peak_stages` order."""
    return tuple((stage, _held_by_microbatches(model, layout, seq_len, num_microbatches,
                                               stage, precision, assumptions))
                 for stage in peak_stages(layout.pp, layout.schedule))
