"""Apply expert parallelism to a model's MoE feed-forwards (the plan's "moe" role).

Each MoE module keeps the row block of its stacked experts that its expert-parallel
index owns (on the meta device: the data-parallel engine draws only those rows), tagged
with what it is a slice of and with the group its gradients are reduced over
("expert_grad_reduce", the dp x cp / ep ranks that hold the same experts), and its token
dispatch becomes the all-to-all of `ExpertParallelDispatch`.

Under tensor parallelism the whole MoE feed-forward (router, experts, shared experts)
is replicated over the tensor group: every tp rank routes the same tokens through the
same experts, exchanging them with the ranks of its own expert group. Tensor parallelism
has then already tagged the parameters as replicated over "tensor"; that is kept.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from partita.comm import GroupComm
from partita.errors import PartitaError
from partita.experts.dispatch import ExpertParallelDispatch
from partita.models import plan as roles
from partita.models.moe import planned_moe_modules
from partita.sharding import ShardInfo, set_reduce_group, set_shard_info, shard_info

EXPERT_PARAMS = ("w_gate", "w_up", "w_down")


def apply_expert_parallel(model: nn.Module, plan: roles.ModelPlan, comm: GroupComm) -> int:
    """Spread the experts of every planned MoE module over `comm`; the number of MoE
    modules on this rank. With one member nothing changes."""
    found = planned_moe_modules(model, plan)
    if comm.size == 1:
        return len(found)
    for name, moe in found:
        experts = moe.experts
        n_experts = moe.cfg.n_experts
        if n_experts % comm.size:
            raise PartitaError(f"model.n_experts={n_experts} is not divisible by "
                               f"parallel.ep={comm.size}")
        n_local = n_experts // comm.size
        first = comm.index * n_local
        for pname in EXPERT_PARAMS:
            old = getattr(experts, pname)
            full_name = f"{name}.experts.{pname}"
            before = shard_info(old, full_name)
            if old.is_meta:
                new = nn.Parameter(torch.empty((n_local, *old.shape[1:]), device="meta",
                                               dtype=old.dtype))
            else:  # a materialised model: keep this rank's rows
                new = nn.Parameter(old.detach()[first:first + n_local].clone())
            set_shard_info(new, ShardInfo(full_name, tuple(old.shape), 0, first,
                                          first + n_local, before.replicated_over))
            set_reduce_group(new, "expert_grad_reduce")
            setattr(experts, pname, new)
        experts.first, experts.n_local = first, n_local
        moe.dispatch = ExpertParallelDispatch(comm, n_experts)
    return len(found)
