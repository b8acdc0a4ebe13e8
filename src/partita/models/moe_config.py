"""Checks of a model's mixture-of-experts settings, with what to change in each message.

Kept apart from the modules (no torch here) so that the planner and the layout checks
read them as plain data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from partita.errors import PartitaError

if TYPE_CHECKING:
    from partita.models.model_config import ModelConfig

GATINGS = ("softmax", "sigmoid")


def check_moe_config(cfg: ModelConfig) -> None:
    """Raise PartitaError for MoE settings no model can be built with."""
    e, k = cfg.n_experts, cfg.top_k
    if e < 0:
        raise PartitaError(f"model.n_experts={e} is invalid: use 0 (dense) or the number of "
                           "experts of each MoE block.")
    if not e:
        return
    if not 1 <= k <= e:
        raise PartitaError(f"model.top_k={k} must be between 1 and model.n_experts={e}: each "
                           "token runs through top_k distinct experts. Lower top_k or add "
                           "experts.")
    if cfg.moe_every < 1:
        raise PartitaError(f"model.moe_every={cfg.moe_every} is invalid: use 1 (every block "
                           "is MoE), 2 (every second block), ...")
    if cfg.moe_every > cfg.n_layers:
        raise PartitaError(f"model.moe_every={cfg.moe_every} exceeds model.n_layers="
                           f"{cfg.n_layers}, so no block would be MoE; use at most "
                           f"{cfg.n_layers}, or model.n_experts=0 for a dense model.")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        raise PartitaError(f"model.capacity_factor={cfg.capacity_factor} must be positive "
                           "(1.0 lets an expert take its even share of every sequence's "
                           "tokens; 1.25 a quarter more); leave it unset (none) for dropless "
                           "routing.")
    if cfg.router_gating not in GATINGS:
        raise PartitaError(f"model.router_gating='{cfg.router_gating}' is unknown; use "
                           "'softmax' or 'sigmoid'.")
    if cfg.expert_ffn_dim is not None and cfg.expert_ffn_dim < 1:
        raise PartitaError(f"model.expert_ffn_dim={cfg.expert_ffn_dim} must be positive.")
    if cfg.shared_experts < 0:
        raise PartitaError(f"model.shared_experts={cfg.shared_experts} must be 0 or more.")
    if cfg.flavour != "llama":
        raise PartitaError("mixture-of-experts blocks use SwiGLU experts: set "
                           "model.flavour=llama, or model.n_experts=0.")
    for name in ("aux_loss_weight", "z_loss_weight"):
        if getattr(cfg, name) < 0:
            raise PartitaError(f"model.{name}={getattr(cfg, name)} must be 0 or more.")
