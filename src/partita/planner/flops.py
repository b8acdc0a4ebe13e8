"""The FLOPs a step does: the recomputed blocks' forward passes that hardware FLOPs
(HFU) count beside the model FLOPs (MFU), as the step time (`planner.timing`) charges
them: which blocks rerun and how often, and each kind of block at its own FLOPs.
"""

from __future__ import annotations

from partita.layout import Layout
from partita.planner.activation_memory import recomputed_layers, selective_reruns_core
from partita.planner.memo import memoised
from partita.planner.model_shape import PlanModel


@memoised()  # a search asks for every layout's recomputation
def layer_forward_flops(model: PlanModel, seq_len: int, mb: int,
                        moe_block: bool | None = None) -> float:
    """Forward FLOPs of one block for `mb` sequences on one device (no parallelism):
    2 per matmul weight per token, plus 4*h*s per token for the score and value
    products (the MFU convention: no causal discount). An MoE block (`moe_block`,
    default: whether the model has experts) multiplies with its router, its shared
    experts and top_k routed experts; a dense block with its MLP. Biases are negligible."""
    c = model.config
    moe = model.is_moe if moe_block is None else moe_block and model.is_moe
    matmul = model.block_split(1, moe=moe)["sharded"]  # attention (+ a dense MLP)
    if moe:
        matmul += (c.dim * model.moe.num_experts  # the router
                   + (c.shared_experts + model.moe.top_k) * model.mlp_params(model.expert_ffn))
    tokens = mb * seq_len
    return 2 * matmul * tokens + 4 * c.dim * seq_len * tokens


def mean_layer_forward_flops(model: PlanModel, seq_len: int) -> float:
    """Forward FLOPs per token of the model's average block: a model with moe_every > 1
    alternates MoE and dense blocks, as `pipeline_times` mixes their times."""
    n_moe = model.moe_layers(0, model.config.n_layers)
    moe, dense = (layer_forward_flops(model, seq_len, 1, kind) / seq_len
                  for kind in (True, False))
    return (n_moe * moe + (model.config.n_layers - n_moe) * dense) / model.config.n_layers


def head_forward_flops(model: PlanModel, seq_len: int, mb: int) -> float:
    return 2 * model.config.padded_vocab_size * model.config.dim * mb * seq_len


def recomputed_share(model: PlanModel, layout: Layout) -> float:
    """The share of a stage's blocks that recomputation reruns: the first
    `recompute_layers` of each stage (all by default; none without recompute)."""
    per_stage = max(1, model.config.n_layers // layout.pp)
    return recomputed_layers(layout, per_stage) / per_stage


def forward_reruns(layout: Layout) -> float:
    """Forward reruns of each recomputed block per microbatch: one, and two under a
    zero-bubble split, whose I and W each rerun it (partita.memory.recompute)."""
    return 2.0 if layout.schedule == "zb-h1" and layout.pp > 1 else 1.0


def recompute_flops_per_token(model: PlanModel, layout: Layout, seq_len: int,
                              compile: str = "none") -> float:
    """FLOPs per token that recomputation adds, as `pipeline_times` charges its time:
    the recomputed blocks' forward (full) or attention score and value products
    (selective), once per rerun; the output layer is not repeated. Compiled (`compile`
    blocks or model) under a zero-bubble split, a fully recomputed block also runs its
    backward (twice the forward's FLOPs) once more."""
    c = model.config
    rerun_blocks = c.n_layers * recomputed_share(model, layout)
    if layout.recompute == "full":
        forward = rerun_blocks * mean_layer_forward_flops(model, seq_len)
        split_compiled = compile != "none" and layout.schedule == "zb-h1" and layout.pp > 1
        return forward * (forward_reruns(layout) + (2 if split_compiled else 0))
    if selective_reruns_core(layout):
        return rerun_blocks * forward_reruns(layout) * 4 * c.dim * seq_len
    return 0.0
