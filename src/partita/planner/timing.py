"""Step time of a layout: compute, the pipeline bubble, and exposed communication.

Compute is timed kernel by kernel from each GEMM's and attention's shape
(`partita.planner.compute`: a roofline plus tile, inner-dimension and launch effects).
Each parallel dimension's communication volume per GPU is computed from the standard
collective costs (ring all-reduce moves 2(n-1)/n of the buffer per GPU, reduce-scatter
and all-gather (n-1)/n each, all-to-all (n-1)/n) and timed on the link its group
uses: NVLink when the group's ranks lie in one node, the GPU's network port otherwise.
The part of each that overlap can hide is `min(comm, overlap * compute beside it)`.

Per microbatch and stage, tp/cp/ep communication lengthens the stage's time (it sits
inside the layers), so it also lengthens the bubble; pipeline p2p, data-parallel
reduction and offload are added once per step. `step_time` puts together its two
halves, `pipeline_times` and `data_parallel_times`: a search memoises each apart, as
every ZeRO stage and offload shares a pipeline, and every schedule a ZeRO group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partita.compile_rules import MODES
from partita.layout import Layout
from partita.planner import context_parallel as cp_model
from partita.planner.activation_memory import layer_input_bytes, selective_reruns_core
from partita.planner.assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from partita.planner.compiled import overlaps_in_effect
from partita.planner.compute import (
    BlockTimes,
    block_times,
    head_times,
    host_times,
    memory_time,
    optimizer_time,
)
from partita.planner.eager_ops import step_ops
from partita.planner.flops import forward_reruns, recompute_flops_per_token, recomputed_share
from partita.planner.hardware import Cluster, GPUSpec
from partita.planner.memo import memoised
from partita.planner.model_shape import PlanModel
from partita.planner.precision import MIXED, Precision
from partita.planner.stage_params import stage_layers, stage_param_counts
from partita.planner.zero_buffers import zero3_buffers, zero_param_counts


def num_microbatches(layout: Layout, global_batch: int) -> int:
    return global_batch // (layout.dp * layout.microbatch_size)


def _collective_time(volume: float, n: int, messages: float, link: tuple[float, float],
                     efficiency: float, assumptions: Assumptions) -> float:
    if n <= 1 or volume <= 0:
        return 0.0
    bw, alpha = link
    steps = 2 * math.log2(n) if assumptions.tree_latency else 2 * (n - 1)
    return volume / (bw * efficiency) + messages * steps * alpha


def tp_boundary_bytes(model: PlanModel, layout: Layout, seq_len: int,
                      precision: Precision = MIXED,
                      assumptions: Assumptions = DEFAULT_ASSUMPTIONS, stage: int = 0) -> float:
    """Tensor-parallel bytes one rank sends per microbatch outside the layers' four
    collectives (with `assumptions.tp_boundary_comm`; the textbook count leaves them out).

    First stage: the vocab-parallel embedding's partial sums (all-reduce, or under sp a
    reduce-scatter forward and all-gather backward: the same bytes). Last stage: the
    head's input (all-reduce backward, or all-gather + reduce-scatter) and the vocab-
    parallel cross-entropy's three all-reduces of one fp32 per token. Every stage: the
    gradients of parameters replicated over tp that see partial inputs, all-reduced in
    backward: norms (and a learned position table, row-parallel biases) under sp; K and
    V projections kept whole when tp exceeds the kv heads.
    """
    t, c = layout.tp, model.config
    if t == 1 or not assumptions.tp_boundary_comm:
        return 0.0
    ring = 2 * (t - 1) / t
    tokens = layout.microbatch_size * seq_len / layout.cp
    act = precision.activation * tokens * c.dim
    first, last = stage == 0, stage == layout.pp - 1
    layers = stage_layers(c.n_layers, layout.pp)[stage]
    vol = ring * act * (first + last) + (3 * ring * 4 * tokens if last else 0.0)
    replicated = 0.0
    if layout.sequence_parallel:
        norm = c.dim * (2 if c.flavour == "gpt2" else 1)
        replicated += layers * 2 * norm + (norm if last else 0)
        replicated += layers * 2 * c.dim if c.has_bias else 0  # row-parallel biases
        if first:
            replicated += c.embedding_param_count() - c.padded_vocab_size * c.dim  # positions
    if assumptions.whole_kv_replicas and c.kv_heads % t:
        kv = c.kv_heads * c.head_dim
        replicated += layers * 2 * (kv * c.dim + (kv if c.has_qkv_bias else 0))
    return vol + ring * precision.grad * replicated


# One object per search (a GPU with its own 16-bit rate is a copy): memoised terms
# such as `block_times` know it by identity.
@memoised()
def rate_for_dtype(gpu: GPUSpec, elem_bytes: int) -> GPUSpec:
    """`gpu` as a run in `elem_bytes`-wide parameters sees it (`GPUSpec.for_dtype_bytes`)."""
    return gpu.for_dtype_bytes(elem_bytes)


def _link(cluster: Cluster, a: Assumptions, span: int) -> tuple[tuple[float, float], float]:
    """The link a group of `span` consecutive ranks talks over, and its efficiency."""
    efficiency = (a.intra_node_efficiency if cluster.within_node(span)
                  else a.inter_node_efficiency)
    return cluster.link(span), efficiency


@dataclass(frozen=True)
class PipelineTimes:
    """The part of a step that the ZeRO stage, offload and the data-parallel overlap
    options leave alone (`pipeline_times`): the microbatches through the pipeline, the
    communication inside and between its stages, and the FLOPs."""

    microbatches: int
    compute_s: float
    bubble_s: float
    pipeline_s: float  # microbatches and bubble
    microbatch_s: float  # of the slowest stage, which paces the pipeline
    pp_exposed_s: float
    layer_comm_s: float  # tp, cp and ep communication left exposed on the slowest stage
    host_stage_s: tuple[float, ...]  # the host's floor per stage and microbatch
    tp_bytes: float
    cp_bytes: float
    ep_bytes: float
    pp_bytes: float
    model_flops: float
    hardware_flops: float


# A search tries every ZeRO stage and offload on the same pipeline: computed once.
@memoised(ignores=("zero_stage", "offload", "overlap_grad_reduce", "overlap_param_gather"))
def pipeline_times(model: PlanModel, layout: Layout, cluster: Cluster, seq_len: int,
                   global_batch: int, precision: Precision = MIXED,
                   assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
                   compile: str = "none") -> PipelineTimes:
    """Seconds of a step's pipeline (`step_time` adds data parallelism, the optimizer
    and offload). `compile`: the `train.compile` mode in effect (none, blocks or model)."""
    a, c = assumptions, model.config
    gpu = rate_for_dtype(cluster.gpu, precision.param)
    m = num_microbatches(layout, global_batch)
    t, cp, ep, pp, v = layout.tp, layout.cp, layout.ep, layout.pp, layout.virtual_stages
    # An MoE model with moe_every > 1 alternates MoE and dense blocks: a layer's time
    # (and its tp and ep traffic) is the mix of the two.
    moe_frac = c.n_moe_layers / c.n_layers if model.is_moe and c.moe else float(model.is_moe)
    # Compiled (a mode in effect, `planner.compiled`): where the preset's kernels are
    # partita's eager ones, blocks (and under `model` the edges) run fused.
    if compile not in MODES or compile == "auto":  # `auto` resolves before (compiled.py)
        raise ValueError(f"compile mode {compile!r} is not one of none, blocks, model")
    compiled = compile if a.compile_gain else "none"
    blk = block_times(model, layout, seq_len, gpu, a, precision.param, compiled)
    if 0 < moe_frac < 1:
        dense = block_times(model.dense_blocks(), layout, seq_len, gpu, a, precision.param,
                            compiled)
        blk = BlockTimes(**{f: moe_frac * getattr(blk, f) + (1 - moe_frac) * getattr(dense, f)
                            for f in BlockTimes.__dataclass_fields__})
    # Recomputation reruns the forward of recompute_layers = K of a stage's layers (all
    # of them by default): full the whole block (4 passes for 3), selective only the
    # attention core; a zero-bubble split reruns it in I and again in W
    # (partita.memory.recompute).
    share, reruns = recomputed_share(model, layout), forward_reruns(layout)
    rerun_s = {"none": 0.0, "selective": blk.attention_core_fwd, "full": blk.fwd}[
        layout.recompute]
    if layout.recompute == "selective" and not selective_reruns_core(layout):
        rerun_s = 0.0  # context parallelism's core is not rerun
    layer_s = blk.fwd + blk.bwd + share * reruns * rerun_s
    # Compiled blocks under a zero-bubble split: a fully recomputed block is an eager
    # autograd function around the compiled forward, and I and W each rerun it through
    # the compiled backward, which computes every gradient each time: one more B. The
    # other blocks' backward is one node whose weight gradients I computes, leaving W
    # nothing of theirs to defer (`pipeline.backward.runs_whole`).
    split_compiled = compile != "none" and layout.schedule == "zb-h1" and pp > 1
    full_share = share if layout.recompute == "full" else 0.0
    if split_compiled:
        layer_s += full_share * blk.bwd
    full_reruns = full_share * reruns
    head_fwd, head_bwd = head_times(model, layout, seq_len, gpu, a, compiled == "model",
                                    precision.param)
    head_s = head_fwd + head_bwd

    def link_eff(span: int) -> tuple[tuple[float, float], float]:
        return _link(cluster, a, span)

    # Tensor parallel: 2 collectives forward, 2 backward (+2 when recomputing forward),
    # all-reduces without sp, all-gather + reduce-scatter pairs (same bytes) with sp.
    act = precision.activation * layout.microbatch_size * seq_len / cp * c.dim
    tp_colls = 4 + (2 * share * reruns if layout.recompute == "full" else 0)
    # An MoE block's FFN replicated over tp: attention's collectives only, and under sp
    # the all-gather of the FFN's input (forward) and of its output gradient (backward),
    # half an all-reduce's bytes each. Split over tp (moe_tp "experts" or "hidden"): an
    # all-reduce of the output forward and of the input gradient backward, like a dense
    # MLP; under sp the forward is an all-gather and a reduce-scatter, the backward an
    # all-gather and an all-reduce of the whole sequence: half an all-reduce more.
    if layout.expert_tp > 1:
        tp_colls *= 1 + moe_frac / (8 if layout.sequence_parallel else float("inf"))
    else:
        tp_colls *= 1 - moe_frac / (4 if layout.sequence_parallel else 2)
    tp_vol = tp_colls * 2 * (t - 1) / t * act if t > 1 else 0.0
    link, le = link_eff(t)
    tp_s = _collective_time(tp_vol, t, tp_colls, link, le, a)
    # Context parallel (planner.context_parallel): keys and values around the ring (or
    # gathered), hidden behind the attention pieces they run beside; a forward again
    # under full recompute.
    link, le = link_eff(t * cp)
    cp_fwd, cp_bwd = cp_model.exposed_time(model, layout, seq_len, blk.attention_core_fwd,
                                           blk.attention_core_bwd, link, le, precision, a)
    cp_s = cp_fwd * (1 + full_reruns) + cp_bwd
    # Expert parallel: dispatch + combine all-to-all forward and backward, and the
    # forward's again in each rerun (the rerun routes identically). With the experts
    # split over tp, each tp rank sends only its own experts' share of the choices.
    ep_colls = 4 + 2 * full_reruns
    ep_vol = (ep_colls * (ep - 1) / ep * model.moe.top_k * act / layout.experts_over_tp
              if ep > 1 else 0.0)
    link, le = link_eff(t * ep)
    ep_s = moe_frac * _collective_time(ep_vol, ep, ep_colls, link, le, a)

    # Outside the layers: embedding, head and loss (first and last stage).
    tp_edge = [tp_boundary_bytes(model, layout, seq_len, precision, a, st)
               for st in range(pp)]
    tp_edge_s = [_collective_time(vol, t, 6, link_eff(t)[0], link_eff(t)[1], a)
                 for vol in tp_edge]

    # TP overlap (userbuffers-style) hides collectives under the GEMMs beside them:
    # forward, backward (twice the forward's) and a recomputed forward.
    gemm_s = blk.gemm_fwd * (3 + (1 if layout.recompute == "full" else 0))
    tp_hide = min(tp_s, a.tp_overlap * gemm_s) if layout.tp_comm_overlap else 0.0
    exposed_layer = (tp_s - tp_hide + a.tp_overlap_slowdown * tp_hide
                     + cp_s
                     + ep_s - min(ep_s, a.ep_overlap * layer_s))
    layers = stage_layers(c.n_layers, pp)
    # Unfused gradient accumulation: after each microbatch's backward every local
    # parameter's gradient is added into the accumulation buffer, at memory speed.
    accum_s = [memory_time(a.grad_accum_bytes_per_param
                           * sum(stage_param_counts(model, layout, st, a).values()), gpu, a, 0)
               if a.grad_accum_bytes_per_param else 0.0 for st in range(pp)]
    stage_s = [n * (layer_s + exposed_layer) + edge + acc
               for n, edge, acc in zip(layers, tp_edge_s, accum_s)]
    stage_s[-1] += head_s
    # The host's floor (compute.host_times): a stage's microbatch takes at least the
    # time its host needs to launch partita's eager operations (the optimizer step's
    # are `step_time`'s).
    host_layer, host_edge, _ = host_times(model, layout, gpu, a, precision.param, 0.0,
                                          full_reruns)
    host_stage = [n * host_layer for n in layers]
    host_stage[-1] += host_edge
    stage_s = [max(s, h) for s, h in zip(stage_s, host_stage)]
    mb_s = max(stage_s)  # the slowest stage paces the pipeline
    # ZB-H1 fills two thirds of the 1F1B bubble with deferred weight-gradient passes,
    # which needs microbatches to defer: with fewer than pp it fills proportionally less.
    # Compiled, only the fully recomputed blocks defer W (above); with none the schedule
    # idles as 1F1B does (simulated: pp=4, m=8, I=2, W=0 ends at 33 units, as
    # (pp - 1) x 3 + 3m).
    zb_fill = 2 / 3 * min(1.0, (m - 1) / (pp - 1)) if pp > 1 else 0.0
    if split_compiled:
        zb_fill *= full_share
    bubble_units = {"interleaved-1f1b": (pp - 1) / v, "zb-h1": (pp - 1) * (1 - zb_fill)}.get(
        layout.schedule, pp - 1)
    compute_s = m * max(max(n * layer_s + (head_s if i == pp - 1 else 0) + accum_s[i],
                            host_stage[i]) for i, n in enumerate(layers))
    bubble_s = bubble_units * mb_s
    pipeline_s = m * mb_s + bubble_s

    # Pipeline p2p: each microbatch crosses each of this rank's v chunks, forward and back.
    p2p = layer_input_bytes(model, layout, seq_len, precision)  # sharded over tp under sp
    if a.pp_scatter_gather and not layout.sequence_parallel:
        p2p /= t
    # Sends of the busiest rank: a middle stage sends activations on and gradients back
    # (2vm); with pp = 2 stage 0 never sends a gradient of its first chunk ((2v-1)m).
    pp_vol = (2 * v - (1 if pp == 2 else 0)) * m * p2p if pp > 1 else 0.0
    stride = t * cp * layout.dp
    link, le = link_eff(2 * stride)
    pp_s = pp_vol / (link[0] * le) + 2 * v * m * link[1] if pp > 1 else 0.0
    pp_exposed = pp_s - min(pp_s, a.pp_overlap * compute_s)

    tokens = global_batch * seq_len
    model_flops = model.flops_per_token(seq_len) * tokens
    return PipelineTimes(
        microbatches=m, compute_s=compute_s, bubble_s=bubble_s, pipeline_s=pipeline_s,
        microbatch_s=mb_s, pp_exposed_s=pp_exposed,
        layer_comm_s=m * max(layers) * exposed_layer, host_stage_s=tuple(host_stage),
        tp_bytes=(tp_vol * max(layers) + max(tp_edge)) * m,
        cp_bytes=cp_model.step_bytes(model, layout, seq_len, max(layers), m, precision, a),
        ep_bytes=ep_vol * m * max(model.moe_layers(sum(layers[:i]), n)
                                  for i, n in enumerate(layers)),
        pp_bytes=pp_vol, model_flops=model_flops,
        hardware_flops=(model_flops
                        + recompute_flops_per_token(model, layout, seq_len, compile) * tokens))


@dataclass(frozen=True)
class DataParallelTimes:
    """The part of a step that data parallelism, the optimizer and offload add, before
    overlap with the pipeline's compute (`data_parallel_times`)."""

    grad_s: float  # gradient reduction
    param_s: float  # parameter gathering
    grad_per_microbatch: bool  # reduced after every microbatch (else once per step)
    param_per_microbatch: bool  # gathered for every microbatch (ZeRO-3)
    dp_bytes: float
    optimizer_s: float  # on the GPU (0 with offload)
    offload_s: float
    # optimizer+params: the parameter shards copied from host memory for every gather
    # (memory.offload.stage_in), part of `param_s`
    stage_in_s: float = 0.0


# Once per ZeRO group, ZeRO stage, offload and microbatch count: every schedule,
# microbatch size and recomputation of a search shares it.
@memoised(ignores=("schedule", "virtual_stages", "microbatch_size", "sequence_parallel",
                   "recompute", "recompute_layers", "cp_kind", "tp_comm_overlap",
                   "overlap_grad_reduce", "overlap_param_gather"))
def data_parallel_times(model: PlanModel, layout: Layout, cluster: Cluster, microbatches: int,
                        precision: Precision = MIXED,
                        assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> DataParallelTimes:
    """Seconds of a step's data-parallel collectives, optimizer step and offload with
    `microbatches` microbatches per step (`step_time` hides them behind the pipeline)."""
    a, m, pp = assumptions, microbatches, layout.pp
    gpu = rate_for_dtype(cluster.gpu, precision.param)
    # Clipping's and the optimizer's operations: per flat buffer of the first stage's
    # parameters (ZeRO shards each buffer, the operations per buffer stay).
    counts = zero_param_counts(model, layout, precision, 0, a)
    step_operations = step_ops(counts["dense"] + counts["expert"], precision.param, a)
    host_step = host_times(model, layout, gpu, a, precision.param, step_operations)[2]

    # Data parallel (over the ZeRO group dp*cp) per ZeRO stage.
    # Collectives move whole flat buffers (padded under `flat_buffer_align`).
    n = layout.zero_group
    n_exp = max(1, n // layout.ep)  # experts reduce over their own group, dp*cp/ep
    local = counts["dense"] + counts["expert"]
    frac = (n - 1) / n if n > 1 else 0.0
    # Bytes moved per family, as if all in the dense group: (n-1)/n of each family
    # over its own group (frac is applied below).
    moved = counts["dense"] + (counts["expert"] * (n_exp - 1) / n_exp / frac if frac else 0.0)
    g_bytes, p_bytes = precision.grad * moved, precision.param * moved
    every_mb = a.sharded_grads_reduce_every_microbatch
    z = layout.zero_stage
    # Gradient reduction and parameter gathering, each hidden by its own overlap option.
    param_per_mb = z == 3
    grad_per_mb = z == 3 or (z == 2 and every_mb)
    if z <= 1:  # all-reduce (= reduce-scatter + all-gather) or reduce-scatter + gather
        grad_vol = frac * g_bytes * (2 if z == 0 else 1)
        param_vol = frac * p_bytes if z == 1 else 0.0
    elif z == 2:
        grad_vol = frac * g_bytes * (m if every_mb else 1)
        param_vol = frac * p_bytes
    else:
        kept = 0  # units gathered once per microbatch instead of twice
        buffers = [zero3_buffers(model, layout, precision, st, a) for st in range(pp)]
        grad_vol = m * frac * g_bytes
        param_vol = m * frac * 2 * p_bytes
        if a.zero3_keeps_root:  # the root group is gathered once per microbatch, not twice
            param_vol -= m * frac * precision.param * buffers[0]["root"]
        for unit, experts in list(zip(buffers[0]["units"],  # and so are the kept units
                                      buffers[0]["unit_experts"]))[::-1][:a.zero3_kept_units]:
            param_vol -= m * precision.param * (frac * unit
                                                + experts * (n_exp - 1) / n_exp)
            # Its experts' units (under ep > 1) are of one size, an MoE block's experts.
            kept += 1 + (round(experts / buffers[0]["experts"][-1]) if experts else 0)
    dp_vol = grad_vol + param_vol
    link, le = _link(cluster, a, layout.tp * layout.cp * layout.dp)
    bucket = max(a.grad_bucket_bytes / 2, 1.0)
    messages = math.ceil(dp_vol / bucket)
    if z == 3:  # per microbatch, each gather unit (and each MoE block's experts under
        # ep > 1): gathered twice (the kept ones once), reduce-scattered once
        messages += 3 * m * sum(len(b["units"]) + len(b["experts"]) for b in buffers) // pp
        messages -= m * kept
    dp_s = _collective_time(dp_vol, n, messages, link, le, a)
    grad_s = dp_s * grad_vol / dp_vol if dp_vol else 0.0
    param_s = dp_s - grad_s
    stage_in_s = 0.0
    if z == 3 and "+params" in layout.offload:
        # The shard at rest lives in host memory: each gather first copies it to the
        # device, prefetched with the gathers (docs/memory.md), so it adds to their time.
        full = frac * p_bytes  # one full gather's bytes on the network
        gathers = param_vol / full if full else 2.0 * m  # per step (kept units once)
        shard_bytes = precision.param * (counts["dense"] / n + counts["expert"] / n_exp)
        stage_in_s = gathers * shard_bytes / gpu.host_link_bandwidth
        param_s += stage_in_s
    # The optimizer step on the GPU (with offload it runs on the host: `offload_s`).
    shard = counts["dense"] / n + counts["expert"] / n_exp if z >= 1 else local
    # After clipping's norm (read on the host) the host launches the step's operations
    # while the GPU waits for them.
    optim_s = (0.0 if layout.offload != "none"
               else max(optimizer_time(shard, gpu, a, step_operations), host_step))

    offload_s = 0.0
    if layout.offload != "none":
        moved = (precision.grad + precision.param) * shard
        offload_s = (moved / gpu.host_link_bandwidth + shard / a.cpu_adam_params_per_s)
        if layout.offload.endswith("+disk"):  # master and moments read and written back
            states = (precision.master or precision.param) + precision.optimizer
            if "+params" in layout.offload:
                # ... and the parameter shard's file, rewritten by the step and read
                # (synchronously) at the first gather; the step's later gathers find
                # the unchanged file in the page cache.
                states += precision.param
            offload_s += 2 * states * shard / a.disk_bandwidth
        offload_s *= 1 - a.offload_overlap

    return DataParallelTimes(grad_s=grad_s, param_s=param_s, grad_per_microbatch=grad_per_mb,
                             param_per_microbatch=param_per_mb, dp_bytes=dp_vol,
                             optimizer_s=optim_s, offload_s=offload_s,
                             stage_in_s=stage_in_s)


def step_time(model: PlanModel, layout: Layout, cluster: Cluster, seq_len: int,
              global_batch: int, precision: Precision = MIXED,
              assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
              compile: str = "none") -> dict[str, float]:
    """Seconds of one optimizer step and its parts; bytes each GPU sends per dimension.
    `compile`: the `train.compile` mode in effect (none, blocks or model)."""
    a = assumptions
    p = pipeline_times(model, layout, cluster, seq_len, global_batch, precision, a, compile)
    d = data_parallel_times(model, layout, cluster, p.microbatches, precision, a)
    compute_s, mb_s = p.compute_s, p.microbatch_s
    grad_s, param_s, optim_s, offload_s = d.grad_s, d.param_s, d.optimizer_s, d.offload_s
    grad_per_mb, param_per_mb = d.grad_per_microbatch, d.param_per_microbatch
    # Once-per-step collectives overlap one microbatch (the last backward, the first
    # forward); per-microbatch ones the whole step's compute. A compiled whole model
    # overlaps neither (`overlaps_in_effect`).
    overlaps = overlaps_in_effect(layout, compile)
    grad_hide = (a.dp_overlap * (compute_s if grad_per_mb else mb_s)
                 if overlaps.overlap_grad_reduce else 0.0)
    param_hide = (a.zero3_overlap * (compute_s if param_per_mb else mb_s)
                  if overlaps.overlap_param_gather else 0.0)
    dp_exposed = grad_s - min(grad_s, grad_hide) + param_s - min(param_s, param_hide)
    step = p.pipeline_s + p.pp_exposed_s + dp_exposed + offload_s + optim_s
    tokens = global_batch * seq_len
    model_flops, hw_flops = p.model_flops, p.hardware_flops
    gpu = rate_for_dtype(cluster.gpu, precision.param)
    comm_exposed = p.layer_comm_s + p.pp_exposed_s + dp_exposed
    host_s = max(p.host_stage_s)
    return {
        "step_s": step,
        "compute_s": compute_s,
        "bubble_s": p.bubble_s,
        "bubble_fraction": p.bubble_s / p.pipeline_s if p.pipeline_s else 0.0,
        "comm_exposed_s": comm_exposed,
        "offload_s": offload_s,
        # Of the parameter gathers' time, the host-to-device copies of optimizer+params.
        "stage_in_s": d.stage_in_s,
        "tokens_per_s": tokens / step,
        "optimizer_s": optim_s,
        # Host seconds per microbatch of the slowest stage (partita's eager operations
        # on a GPU, compute.host_times; 0 where not modelled), and whether they, not
        # the GPU, pace the step.
        "host_s": host_s,
        "host_bound": host_s >= mb_s > 0,
        "mfu": model_flops / step / (cluster.num_gpus * gpu.peak_flops),
        # The papers' figures: model FLOP/s per GPU (6N + attention, no recompute) and
        # hardware FLOP/s per GPU (the recomputed forward counted too).
        "model_flops_per_gpu": model_flops / step / cluster.num_gpus,
        "hardware_flops_per_gpu": hw_flops / step / cluster.num_gpus,
        "hfu": hw_flops / step / (cluster.num_gpus * gpu.peak_flops),
        "tp_bytes": p.tp_bytes,
        "cp_bytes": p.cp_bytes,
        "ep_bytes": p.ep_bytes,
        "pp_bytes": p.pp_bytes,
        "dp_bytes": d.dp_bytes,
    }
