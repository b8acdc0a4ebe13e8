"""What a step's MoE feed-forwards did, summed over the ranks: the auxiliary losses,
tokens per expert and the load imbalance; and the runner that scales the auxiliary
losses' gradient like the main loss's."""

from __future__ import annotations

import torch
import torch.nn as nn

from partita.mesh import Mesh
from partita.models.moe import moe_modules


def moe_step_stats(model: nn.Module, mesh: Mesh) -> dict:
    """The step's MoE figures (empty for a dense model), then every counter reset.

    Collective over the loss_average and pipeline groups: every rank calls it.
    `aux_loss` and `z_loss` are the unweighted means over MoE layers and sequences
    (tokens); `tokens_per_expert` is the mean over MoE layers of each expert's routed
    choices (before any dropping); `imbalance` is its max/mean; `dropped` the share of
    choices dropped by capacity. Tensor-parallel peers hold identical copies and are
    not summed. Context-parallel peers route their own tokens but each records the
    balance loss of the whole sequences they share: it is summed cp times, and so is
    its count of sequences, which leaves the mean as it is.
    """
    found = [m for _, m in moe_modules(model)]
    cfg = getattr(model, "cfg", None)
    if not found and (cfg is None or not getattr(cfg, "moe", False)):
        return {}
    n_experts = found[0].cfg.n_experts if found else cfg.n_experts
    vec = torch.zeros(6 + n_experts, dtype=torch.float64)
    for m in found:
        s = m.stats
        vec[:6] += torch.tensor([s.aux, s.z, s.sequences, s.tokens, s.dropped, 1.0],
                                dtype=torch.float64)
        vec[6:] += s.counts
        s.reset()
    values = mesh.comm("loss_average").all_reduce_scalars(vec.tolist())
    if mesh.dims.pp > 1:
        values = mesh.comm("pipeline").all_reduce_scalars(values)
    aux, z, seqs, tokens, dropped, _ = values[:6]
    layers = mesh.comm("pipeline").all_reduce_scalars([float(len(found))])[0] \
        if mesh.dims.pp > 1 else float(len(found))
    counts = [c / max(layers, 1.0) for c in values[6:]]
    mean = sum(counts) / max(len(counts), 1)
    return {"aux_loss": aux / max(seqs, 1.0), "z_loss": z / max(tokens, 1.0),
            "tokens_per_expert": counts, "imbalance": max(counts) / mean if mean else 0.0,
            "dropped": dropped / max(sum(values[6:]), 1.0)}


class MoERunner:
    """Wraps a step runner: before each step sets every MoE module's auxiliary-loss
    gradient scale to the main loss's (loss scale / microbatches)."""

    def __init__(self, runner, module: nn.Module, loss_scale) -> None:
        self.inner, self.module, self.loss_scale = runner, module, loss_scale

    def train(self, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
              segments: torch.Tensor | None = None,
              targets_per_rank: float | None = None) -> float:
        scale = self.loss_scale() / microbatches
        for _, m in moe_modules(self.module):
            m.aux_grad_scale = scale
        return self.inner.train(inputs, targets, microbatches, segments, targets_per_rank)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 segments: torch.Tensor | None = None,
                 targets_per_rank: float | None = None) -> float:
        return self.inner.evaluate(inputs, targets, segments, targets_per_rank)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
