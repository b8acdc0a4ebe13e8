"""Apply expert parallelism to a model's MoE feed-forwards (the plan's "moe" role).

Each MoE module keeps the row block of its stacked experts that its expert-parallel
index owns (on the meta device: the data-parallel engine draws only those rows), tagged
with what it is a slice of and with the group its gradients are reduced over
("expert_grad_reduce", the dp x cp / ep ranks that hold the same experts), and its token
dispatch becomes the all-to-all of `ExpertParallelDispatch`.

Under tensor parallelism every tp rank routes the same tokens and exchanges them with
the ranks of its own expert group. With parallel.moe_tp="replicate" each tp rank holds
all experts (tagged replicated over "tensor", which is kept); with "experts" tensor
parallelism has already cut the stack to this tp rank's E/tp experts, and expert
parallelism divides that block again; with "hidden" it has cut each expert's width,
and expert parallelism adds the cut of the experts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from partita.comm import GroupComm
from partita.errors import PartitaError
from partita.experts.dispatch import ExpertParallelDispatch
from partita.models import plan as roles
from partita.models.moe import EXPERT_PARAMS, planned_moe_modules
from partita.sharding import ShardInfo, set_reduce_group, set_shard_info, shard_info


def apply_expert_parallel(model: nn.Module, plan: roles.ModelPlan, comm: GroupComm) -> int:
    """Spread the experts of every planned MoE module over `comm`; the number of MoE
    modules on this rank. With one member nothing changes."""
    found = planned_moe_modules(model, plan)
    if comm.size == 1:
        return len(found)
    for name, moe in found:
        experts = moe.experts
        routed = experts.n_local  # the experts this rank's tokens may go to (E or E/tp)
        if routed % comm.size:
            over_tp = "" if routed == moe.cfg.n_experts else (
                f" (the {routed} that each tp rank holds with parallel.moe_tp='experts')")
            raise PartitaError(f"the experts{over_tp} are not divisible by "
                               f"parallel.ep={comm.size}; model.n_experts="
                               f"{moe.cfg.n_experts}")
        n_local = routed // comm.size
        first = comm.index * n_local  # within this rank's routed block
        for pname in EXPERT_PARAMS:
            old = getattr(experts, pname)
            full_name = f"{name}.experts.{pname}"
            before = shard_info(old, full_name)
            # Already split over tp: a block of experts (moe_tp="experts": ours lies
            # within it) or each expert's width (moe_tp="hidden": a further cut).
            offset = before.start if before.dim == 0 else 0
            more = before.more if before.dim in (0, None) else before.cuts
            # Frozen experts stay frozen (nn.Parameter would make them trainable).
            if old.is_meta:
                new = nn.Parameter(torch.empty((n_local, *old.shape[1:]), device="meta",
                                               dtype=old.dtype),
                                   requires_grad=old.requires_grad)
            else:  # a materialised model: keep this rank's rows
                new = nn.Parameter(old.detach()[first:first + n_local].clone(),
                                   requires_grad=old.requires_grad)
            set_shard_info(new, ShardInfo(full_name, before.global_shape, 0, offset + first,
                                          offset + first + n_local, before.replicated_over,
                                          more))
            set_reduce_group(new, "expert_grad_reduce")
            setattr(experts, pname, new)
        experts.first, experts.n_local = experts.first + first, n_local
        moe.dispatch = ExpertParallelDispatch(comm, routed)
    return len(found)
