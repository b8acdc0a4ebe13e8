"""Token dispatch over the expert group: permute, all-to-all, local experts, back.

With e ranks in the expert group and E experts, rank r holds experts
r*E/e .. (r+1)*E/e - 1. A forward of one MoE feed-forward on every rank of the group:

1. sort this rank's kept (token, choice) pairs by expert: destination-rank order;
2. exchange the per-expert counts (one small all-to-all), so every rank knows how many
   rows it receives from each peer for each of its experts;
3. all-to-all the rows (variable splits);
4. run each local expert over the rows each peer sent it, where they lie;
5. all-to-all the outputs back (the splits reversed);
6. sum each token's outputs with its gate weights (`partita.models.moe.combine`).

Both all-to-alls are autograd functions whose backward is the all-to-all with the splits
swapped, so backward mirrors forward: two more all-to-alls. Every rank runs every step,
with zero rows where it has none, so a rank whose experts receive no token still joins
each collective.
"""

from __future__ import annotations

import torch

from partita.comm import GroupComm
from partita.models.moe import Experts, Route, combine, sort_by_expert

# CommCounter operation names: the token rows, and the split-size exchange before them.
ROWS_OP, SPLITS_OP = "all_to_all", "all_to_all_splits"


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, out_splits, in_splits):
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, ROWS_OP)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits,
                                   ROWS_OP)
        return out, None, None, None


def all_to_all(x: torch.Tensor, comm: GroupComm, out_splits: list[int],
               in_splits: list[int]) -> torch.Tensor:
    """Autograd-aware all-to-all of rows with variable splits."""
    return _AllToAll.apply(x, comm, out_splits, in_splits)


class ExpertParallelDispatch:
    """MoE.dispatch under expert parallelism over `comm` (see the module docstring)."""

    def __init__(self, comm: GroupComm, n_experts: int) -> None:
        self.comm, self.n_experts = comm, n_experts

    def __call__(self, x: torch.Tensor, route: Route, experts: Experts) -> torch.Tensor:
        comm, n_local = self.comm, experts.n_local
        _, token, weight, counts = sort_by_expert(route, self.n_experts)
        # Step 2: received[s][l] = rows peer s sends for local expert l.
        received = torch.empty_like(counts)
        comm.all_to_all_single(received, counts, [n_local] * comm.size,
                               [n_local] * comm.size, SPLITS_OP)
        sent, received = torch.stack((counts, received)).view(2, comm.size, n_local).tolist()
        in_splits, out_splits = [sum(r) for r in sent], [sum(r) for r in received]
        rows = all_to_all(x.index_select(0, token), comm, out_splits, in_splits)
        # Step 4: rows arrive by source rank, then local expert; each (source, expert)
        # segment runs where it lies, so the outputs are already in the order to send
        # back (regrouping expert-major would cost a gather and a scatter each way).
        y = experts(rows, [c for r in received for c in r], list(range(n_local)) * comm.size)
        y = all_to_all(y, comm, in_splits, out_splits)
        return combine(y, token, weight, x)
