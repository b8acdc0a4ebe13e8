"""Routing of a mixture-of-experts feed-forward when each rank holds two chunks of
every sequence (context parallelism).

Routing is per token, so each rank routes its own tokens and nothing is computed
twice. Two things are per sequence and need the other chunks:

- the balance loss E x sum_e f_e x P_e: the shares f and summed probabilities P of each
  sequence are summed over the context group first (`sum_everywhere`, whose backward
  sums the gradients too: every rank computes the same loss from the sums and each
  keeps its own tokens' part of its gradient);
- capacity: a choice's place in its expert's queue counts the choices of earlier slots
  over the whole sequence, then the earlier tokens of its own slot. Each rank
  all-gathers the count per (sequence, slot, chunk, expert) and adds the counts of the
  chunks before its own.

`partita.models.moe.MoE` calls these through `MoE.split` (set by
`apply_context_parallel`), as it calls nothing of torch.distributed itself.
"""

from __future__ import annotations

import torch

from partita.comm import GroupComm, gather_along, sum_everywhere
from partita.context_parallel.sharding import chunks_of
from partita.eager_only import EagerOnly


class SplitSequence:
    """What an MoE feed-forward needs from the other ranks holding its sequences."""

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm
        self.parts = comm.size  # the whole sequence is this many times the local one

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums (batch, ...) over the whole sequence, differentiably."""
        return sum_everywhere(x, self.comm)

    def queue_positions(self, hot: torch.Tensor) -> torch.Tensor:
        """Place (from 0) of each local choice in its expert's queue over the whole
        sequence: `hot` (batch, slot, local token, expert) one-hot, local tokens being
        this rank's two chunks in order; returns (batch, slot, local token)."""
        return _queue_positions(hot, self.comm)


@EagerOnly
def _queue_positions(hot: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    b, k, s, e = hot.shape
    degree, n = comm.size, s // 2
    halves = hot.view(b, k, 2, n, e)
    local = halves.sum(3)  # (b, k, 2, E): choices per chunk of this rank
    every = gather_along(local.unsqueeze(0).contiguous(), comm, 0)  # (ranks, b, k, 2, E)
    counts = local.new_zeros(b, k, 2 * degree, e)  # per chunk, in sequence order
    for rank in range(degree):
        for half, chunk in enumerate(chunks_of(rank, degree)):
            counts[:, :, chunk] = every[rank, :, :, half]
    per_slot = counts.sum(2)  # (b, k, E)
    before_slot = per_slot.cumsum(1) - per_slot  # choices of earlier slots
    before_chunk = counts.cumsum(2) - counts  # earlier chunks of the same slot
    mine = before_chunk[:, :, list(chunks_of(comm.index, degree))]  # (b, k, 2, E)
    base = (before_slot.unsqueeze(2) + mine).unsqueeze(3)  # (b, k, 2, 1, E)
    position = ((base + halves.cumsum(3)) * halves).sum(-1) - 1
    return position.reshape(b, k, s)
