"""Activation memory: the bytes one transformer layer saves for backward.

Two forms:

* `korthikanti_layer_bytes` is the closed formula of Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models" (GPT block, 16-bit
  activations, dropout): s*b*h*(34 + 5*a*s/h) bytes per layer, with tensor and
  sequence parallelism and selective/full recompute. Kept as the reference the term
  by term model is tested against.
* `layer_activation_terms` names every saved tensor, so it also covers GQA, SwiGLU,
  no-dropout models, flash attention (no s x s scores), context parallelism and MoE,
  and so a test can compare each term with what autograd really saved.

Symbols: s tokens of a sequence on this GPU (seq_len / cp), b microbatch size, h model
width, a attention heads, t tensor-parallel degree, f MLP hidden width, e bytes per
activation element.
"""

from __future__ import annotations

from partita.layout import OVERLAP_OPTIONS, Layout
from partita.planner.assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from partita.planner.memo import memoised
from partita.planner.model_shape import PlanModel
from partita.planner.precision import MIXED, Precision


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none", attention_kernel: str = "eager") -> float:
    """Bytes saved by one GPT layer (Korthikanti et al. 2022, Table 2 and Sec. 4).

    No parallelism: sbh(34 + 5as/h). Tensor parallel: sbh(10 + 24/t + 5as/(ht)).
    With sequence parallelism the 10 replicated bytes are sharded too: sbh/t(34 + 5as/h).
    Selective recompute (and flash attention, which never stores the scores) drops the
    5as/h term; full recompute keeps only each layer's input, 2sbh (/t with sp).
    """
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    scores = 0.0 if recompute == "selective" or attention_kernel == "flash" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + scores)
    return sbh * (10 + 24 / t + scores / t)


# A layer's terms read tp, cp, the microbatch size, sequence parallelism and moe_tp (the
# weight pass also full recompute), not how the layers are spread or the states
# sharded; a search computes each once per value of those (`planner.memo`).
NOT_READ_BY_LAYER_TERMS = ("dp", "pp", "ep", "zero_stage", "schedule", "virtual_stages",
                           "recompute", "recompute_layers", "offload", "cp_kind",
                           *OVERLAP_OPTIONS)


@memoised(ignores=NOT_READ_BY_LAYER_TERMS)
def layer_activation_terms(model: PlanModel, layout: Layout, seq_len: int,
                           precision: Precision = MIXED,
                           assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> dict[str, float]:
    """Named bytes one layer saves for backward for one microbatch, on one GPU, no recompute.

    Terms that sequence parallelism shards are divided by t only when it is on; terms
    inside the tensor-parallel region always are. The partita-specific fields of
    `Assumptions` (see `Assumptions.measured_cpu`) add what partita's eager model keeps.
    """
    c, a = model.config, assumptions
    t, e = layout.tp, precision.activation
    s, b, h = seq_len / layout.cp, layout.microbatch_size, c.dim
    sp_div = t if layout.sequence_parallel else 1
    # Column-parallel inputs: the sequence shard (Megatron re-gathers it in backward) or
    # the gathered full sequence (partita keeps what it gathered).
    in_div = 1 if a.sp_saves_gathered_input else sp_div
    kv = -(-c.kv_heads // t) * c.head_dim  # kv width per rank (replicated when t > kv heads)
    if a.gqa_expanded_kv:
        kv = h / t  # K and V repeated to every query head before the kernel
    dropout = c.dropout > 0
    terms = {
        # Norm inputs (fused kernels save the input only; eager ones also the output).
        "norm_inputs": 2 * norm_bytes(model, s * b / sp_div, precision, a),
        # Input of the fused QKV projection and of the first MLP projection: the normed
        # activations, sharded along the sequence under sp (re-gathered in backward).
        "qkv_input": e * s * b * h / in_div,
        "mlp_input": e * s * b * h / in_div,
        # Q, K and V, inputs of the score and value products (or of the flash kernel).
        "attention_qkv": e * s * b * (h / t + 2 * kv),
        "attention_scores": attention_score_bytes(model, layout, seq_len, precision, a),
        # Attention output: input of the output projection (and saved by flash).
        "attention_output": e * s * b * h / t,
        # One byte per element: after attention's out-projection and after the MLP.
        "dropout_masks": (2 * s * b * h / sp_div) if dropout else 0.0,
        "mlp_hidden": mlp_hidden_bytes(model, layout, seq_len, precision, a),
    }
    if layout.cp > 1 and a.cp_eager_pieces:
        # Context-parallel attention keeps a log-sum-exp per head and query (no scores)
        # and its merged output in the compute dtype: the projection's input itself in
        # fp32 and fp64 (as one process's flash output is), an fp32 tensor beside it
        # under 16-bit training (`context_parallel.blocks.merged_output`).
        terms["attention_scores"] = 4.0 * c.n_heads / t * s * b
        terms["cp_output"] = (4.0 if e < 4 else 0.0) * s * b * h / t
    if a.rotary_tables_saved and c.flavour == "llama":
        # cos and sin, batch-free: the compiled model's in the activations' dtype, eager
        # code's as one complex table, float32 at the least (16-bit q and k rotate in
        # float32, `models.rotary.RotateInFloat32`).
        table = e if a.compiled_model else max(e, 4)
        terms["rotary_tables"] = 2 * table * s * c.head_dim / 2
    if a.norm_kernel == "eager" and layout.sequence_parallel and t > 1:
        # Sequence-parallel norms use a clone of their weight (and bias), kept for backward.
        terms["norm_weight_copies"] = 2 * (2 if c.flavour == "gpt2" else 1) * precision.param * h
    if a.whole_kv_replicas and t > 1 and c.kv_heads % t:
        # kv heads replicated over tp: the rows this rank reads are index-selected from
        # the K and V weights, and those copies are saved.
        terms["kv_weight_rows"] = 2 * precision.param * -(-c.kv_heads // t) * c.head_dim * h
    if model.is_moe:
        # The MoE feed-forward runs on the whole sequence on every tp rank (under sp on
        # the gathered one), and its router keeps that input.
        terms["mlp_input"] = e * s * b * h
        terms.update(moe_terms(model, layout, seq_len, precision))
    return terms


def moe_terms(model: PlanModel, layout: Layout, seq_len: int,
              precision: Precision = MIXED) -> dict[str, float]:
    """What an MoE feed-forward saves besides its input (partita's `models.moe`, balanced
    routing, dropless). Every tp rank routes every token; with parallel.moe_tp="experts"
    its experts take 1/tp of the choices, so the per-row terms divide by tp ("hidden":
    every choice, each through 1/tp of an expert's width).

    The dispatch and combine buffers are activations: the rows each rank's experts
    receive through the all-to-all (top_k per token when routing is balanced) are saved
    as the experts' input, the rows sent back as the gate product's input (and the
    product for the scatter-add); all are freed with the graph after backward, like
    every other saved tensor, so the model-state ledger does not list them.
    """
    k, n_e = model.moe.top_k, model.moe.num_experts
    e = precision.activation
    n = seq_len / layout.cp * layout.microbatch_size  # tokens this rank routes
    rows = k * n / layout.experts_over_tp  # the choices this rank's experts run
    b = layout.microbatch_size
    return {
        # Input of each expert's up and gate projections (after the all-to-all).
        "moe_dispatch": e * rows * model.config.dim,
        # Expert outputs back from the all-to-all: input of the gate-weight product, and
        # that product, the source the scatter-add back to tokens keeps.
        "moe_combine": 2 * e * rows * model.config.dim,
        # Router, in fp32: softmax output, the logits the z-loss's log-sum-exp reads and
        # its per-token output, each sequence's expert shares (balance loss).
        "moe_router": 4 * (2 * n * n_e + n + b * n_e),
        # Gate weights: the chosen scores (fp32), their per-token sum (top-k
        # normalisation) and each row's weight; the int64 indices that route each row:
        # chosen experts, sort order, token (received rows are not regrouped under
        # expert parallelism: each expert runs over them where they lie).
        "moe_gates": 4 * k * n + 4 * n + e * rows,
        "moe_indices": 8 * k * n + 8 * rows * 2,
    }


def norm_bytes(model: PlanModel, tokens: float, precision: Precision = MIXED,
               assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """What one norm over `tokens` tokens saves.

    Fused: `norm_saved_tensors` tensors of width h. Eager (partita's model): RMSNorm
    normalises in fp32, so it keeps an fp32 copy of its input, the normalised output and
    an fp32 rsqrt per token; LayerNorm (torch's kernel) its input and fp32 mean and rstd.
    Compiled (partita's RMSNorm in a block `train.compile` fuses): its input and the
    rsqrt; the normalised output is recomputed in backward.
    """
    h, e = model.config.dim, precision.activation
    if assumptions.norm_kernel == "fused":
        return assumptions.norm_saved_tensors * e * tokens * h
    if assumptions.norm_kernel == "compiled":
        return tokens * (e * h + 4)
    if model.config.flavour == "gpt2":
        return tokens * (e * h + 8)
    return tokens * ((max(e, 4) + e) * h + 4)


def explicit_scores(model: PlanModel, layout: Layout, seq_len: int, activation_bytes: int,
                    assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> bool:
    """Whether attention computes (and, without selective recompute, keeps) the s x s
    scores: always under "eager", never under "flash"; under "model" as partita's
    `AttentionCore` decides (`partita.models.attention_kernel`; 16-bit activations
    count as bf16, and context parallelism runs its own kernels)."""
    kind = assumptions.attention_kernel
    if kind != "model":
        return kind == "eager"
    if layout.cp > 1:
        return False
    from partita.models.attention_kernel import uses_explicit_scores

    dtype = {2: "bfloat16", 4: "float32"}.get(activation_bytes, "float64")
    scores = layout.microbatch_size * model.config.n_heads / layout.tp * seq_len ** 2
    return uses_explicit_scores(model.config.attention, assumptions.device_type, dtype,
                                scores, assumptions.cpu_bf16_units)


def attention_score_bytes(model: PlanModel, layout: Layout, seq_len: int,
                          precision: Precision = MIXED,
                          assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """The s x s part. Eager: softmax output (+ dropout mask and output with dropout;
    partita's explicit scores have no dropout).

    Flash attention saves one fp32 log-sum-exp per head and query instead. Under
    context parallelism each GPU's queries (seq/cp) meet every key (seq).
    """
    c, e = model.config, precision.activation
    s_q, b, heads = seq_len / layout.cp, layout.microbatch_size, c.n_heads / layout.tp
    if not explicit_scores(model, layout, seq_len, e, assumptions):
        return 4.0 * heads * s_q * b
    dropout = c.dropout > 0 and assumptions.attention_kernel == "eager"
    per_score = e + ((1 + e) if dropout else 0)
    return per_score * heads * s_q * seq_len * b


def mlp_hidden_bytes(model: PlanModel, layout: Layout, seq_len: int,
                     precision: Precision = MIXED,
                     assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Hidden-width tensors of the MLP: GELU saves its input and fc2's input (2 of width f);
    SwiGLU saves gate and up projections and fc2's input (3 with a fused kernel, 4 in
    eager PyTorch, which also keeps silu(gate)). MoE: top_k tokens through each expert."""
    c = model.config
    s, b, e = seq_len / layout.cp, layout.microbatch_size, precision.activation
    tensors = assumptions.swiglu_saved_tensors if c.gated_mlp else 2
    if model.is_moe:  # experts are replicated, or split over tp by experts or width
        return model.moe.top_k * tensors * e * s * b * model.expert_ffn / layout.expert_tp
    return tensors * e * s * b * c.ffn_hidden / layout.tp


def layer_input_bytes(model: PlanModel, layout: Layout, seq_len: int,
                      precision: Precision = MIXED) -> float:
    """A layer's input: all that full recompute keeps per layer (sharded under sp)."""
    sp_div = layout.tp if layout.sequence_parallel else 1
    return precision.activation * seq_len / layout.cp * layout.microbatch_size * model.config.dim / sp_div


@memoised(ignores=tuple(f for f in NOT_READ_BY_LAYER_TERMS if f != "recompute"))
def layer_activation_bytes(model: PlanModel, layout: Layout, seq_len: int,
                           precision: Precision = MIXED,
                           assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Bytes one layer keeps between its forward and backward under layout.recompute."""
    # A compiled region that reruns the attention core saves a generator state for it
    # where the kernel takes a dropout argument (torch's); explicit scores draw nothing.
    explicit = explicit_scores(model, layout, seq_len, precision.activation, assumptions)
    generator_state = 0.0 if explicit else assumptions.generator_state_bytes
    if layout.recompute == "full":
        kept = layer_input_bytes(model, layout, seq_len, precision)
        if assumptions.compiled_model:
            # A checkpoint region of the compiled model: the compiler reruns it from its
            # inputs, the rotary tables among them, and the generator state.
            terms = layer_activation_terms(model, layout, seq_len, precision, assumptions)
            kept += terms.get("rotary_tables", 0.0) + generator_state
        return kept
    terms = layer_activation_terms(model, layout, seq_len, precision, assumptions)
    if selective_reruns_core(layout):
        terms["attention_scores"] = 0.0  # recomputed from Q and K in backward
        if assumptions.compiled_blocks:
            # Inside a compiled block the core reruns from a saved generator state
            # (`memory.recompute`). Without tp its output, which eager keeps as the
            # output projection's input, is rerun with it; under tp, where the block's
            # compiled pieces end at the collectives, the output is kept (measured: tp=2,
            # with and without sp, fp32 and bf16, compiled blocks and model).
            # Explicit scores: the output is kept without tp too (measured, bf16: the
            # compiler saves the product rather than rerun the two GEMMs behind it).
            kept = terms["attention_output"] if layout.tp > 1 or explicit else 0.0
            terms["attention_output"] = kept + generator_state
    return sum(terms.values())


def selective_reruns_core(layout: Layout) -> bool:
    """Whether selective recompute reruns the attention core. Not under context
    parallelism: its core keeps no scores (a log-sum-exp per query and its output), so
    partita leaves it alone rather than repeat the key/value exchange in backward."""
    return layout.recompute == "selective" and layout.cp == 1


@memoised(ignores=tuple(f for f in NOT_READ_BY_LAYER_TERMS if f != "recompute"))
def weight_pass_terms(model: PlanModel, layout: Layout, seq_len: int,
                      precision: Precision = MIXED,
                      assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> dict[str, float]:
    """Named bytes one layer holds for one microbatch between its input-gradient pass (I)
    and its deferred weight-gradient pass (W) in a zero-bubble schedule.

    W reads what each weight's gradient needs and nothing else: the inputs of the
    linear layers and of the norms' weights, and the output gradients I recorded at
    each of them (Qi et al. count the same: W keeps linear inputs and output
    gradients). Everything else a layer saved (attention internals, the MLP's
    activation inputs) is released after I. The output gradients are as large as the
    activations themselves (the MLP's up projections dominate), so a microbatch waiting
    for W can hold more than one running forward does (llama3-8b, fused kernels: 21 sbh
    against 17 sbh activation elements per layer).
    """
    c = model.config
    t, e = layout.tp, precision.activation
    s, b, h = seq_len / layout.cp, layout.microbatch_size, c.dim
    sp_div = t if layout.sequence_parallel else 1
    full = layer_activation_terms(model, layout, seq_len, precision, assumptions)
    kv = -(-c.kv_heads // t) * c.head_dim
    # MoE: top_k copies of each token through an expert's projections (not measured).
    ffn = model.expert_ffn * model.moe.top_k if model.is_moe else c.ffn_hidden
    up_outputs = 2 if c.gated_mlp else 1  # gate and up, or fc1
    terms = {
        "linear_inputs": (full["qkv_input"] + full["mlp_input"] + full["attention_output"]
                          + e * s * b * ffn / t),  # fc2's input
        # Output gradients of QKV, the output projection, the MLP's up projection(s) and
        # fc2 (row-parallel outputs are full width before their reduction).
        "linear_output_grads": e * s * b * ((h + 2 * kv) / t + h + up_outputs * ffn / t + h),
        "norm_output_grads": 2 * e * s * b * h / sp_div,
    }
    terms["norm_inputs"] = 2 * norm_weight_pass_bytes(model, s * b / sp_div, precision,
                                                      assumptions)
    if layout.recompute == "full":
        # The layer is one node of the graph (partita.memory.recompute): W re-enters it
        # with the gradient I recorded at its output and reruns it from its input.
        return {"layer_input": layer_input_bytes(model, layout, seq_len, precision),
                "layer_output_grad": e * s * b * h / sp_div}
    return terms


@memoised(ignores=tuple(f for f in NOT_READ_BY_LAYER_TERMS if f != "recompute"))
def recompute_transient_bytes(model: PlanModel, layout: Layout, seq_len: int,
                              precision: Precision = MIXED,
                              assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """What a rerun adds while one layer's backward runs, beyond what the layer kept.

    Full: the layer's whole working set, less its input where a norm saves the input
    itself (LayerNorm, a fused or compiled norm, or an eager RMSNorm whose fp32 copy of
    an fp32 input is the input). Selective: what the attention core saves when it runs with
    autograd (its output and the scores or, for a flash kernel, the log-sum-exp); under
    context parallelism nothing (`selective_reruns_core`); inside compiled blocks
    nothing either: the core reruns within the compiled backward, whose buffers are
    working memory like those of every other operation it recomputes (norms, SwiGLU),
    which the planner does not count."""
    if layout.recompute == "none":
        return 0.0
    if layout.recompute == "selective" and (not selective_reruns_core(layout)
                                            or assumptions.compiled_blocks):
        return 0.0  # context parallelism: nothing reruns; compiled: see above
    if layout.recompute == "full" and assumptions.compiled_model:
        return 0.0  # the block reruns inside the compiled model's backward
    terms = layer_activation_terms(model, layout, seq_len, precision, assumptions)
    if layout.recompute == "selective":
        return terms["attention_scores"] + terms["attention_output"]
    shares_input = (assumptions.norm_kernel in ("fused", "compiled")
                    or model.config.flavour == "gpt2" or precision.activation >= 4)
    return sum(terms.values()) - (layer_input_bytes(model, layout, seq_len, precision)
                                  if shares_input else 0.0)


def recompute_bias_bytes(model: PlanModel, layout: Layout, seq_len: int,
                         precision: Precision = MIXED,
                         assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """What a compiled model with recomputed layers keeps once per microbatch: its
    regions share one causal bias (seq x seq) around explicit scores, saved for their
    reruns (measured: bf16, full and selective recompute). 0 elsewhere."""
    if assumptions.compiled_model and explicit_scores(model, layout, seq_len,
                                                      precision.activation, assumptions):
        return precision.activation * seq_len ** 2
    return 0.0


def recomputed_layers(layout: Layout, layers: int) -> int:
    """How many of a stage's `layers` layers rerun (the first `recompute_layers`)."""
    if layout.recompute == "none":
        return 0
    return min(layout.recompute_layers, layers) if layout.recompute_layers else layers


def norm_weight_pass_bytes(model: PlanModel, tokens: float, precision: Precision = MIXED,
                           assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """What one norm over `tokens` tokens keeps for its deferred weight gradient. Eager
    RMSNorm: the normalised input before the weight. Otherwise one kernel computes the
    input and weight gradients, so W re-runs it whole and keeps what it saved."""
    if assumptions.norm_kernel == "eager" and model.config.flavour == "llama":
        return precision.activation * tokens * model.config.dim
    return norm_bytes(model, tokens, precision, assumptions)


def inflight_chunks(layout: Layout, stage: int, num_microbatches: int) -> float:
    """Model chunks' worth of microbatch activations stage `stage` holds at its peak.

    GPipe holds every microbatch. 1F1B (and zero-bubble H1) holds pp - stage. Interleaved
    1F1B warms up 2(pp - stage - 1) + (v - 1)pp + 1 chunks of 1/v of the stage's layers,
    which for stage 0 is Korthikanti's pp * (1 + (pp - 1)/(pp v)) stages' worth.
    Returned in units of chunks (1/vpp of the stage's layers).
    """
    pp, v, m = layout.pp, layout.virtual_stages, num_microbatches
    if pp == 1:
        return v  # one microbatch through every chunk
    if layout.schedule == "gpipe":
        return m * v
    if layout.schedule == "interleaved-1f1b":
        return min(m * v, 2 * (pp - stage - 1) + (v - 1) * pp + 1)
    return min(m, pp - stage) * v
