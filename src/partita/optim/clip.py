"""Global gradient-norm clipping over gradients split between ranks and groups.

The norm is that of the whole model's gradient, as one process would compute it with
torch.nn.utils.clip_grad_norm_: every rank sums the squares of the gradient elements it
alone accounts for (`squared_sum`; which elements those are is the caller's layout
knowledge: a shard, not a replicated copy), then the sums are added over each group
that splits the gradient (`global_norm`). The clip factor is torch's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch


class ScalarGroup(Protocol):
    """A process group that sums a few Python numbers (partita.comm.GroupComm)."""

    def all_reduce_scalars(self, values: list[float]) -> list[float]: ...


def squared_sum(pieces: Iterable[torch.Tensor], device: torch.device) -> float:
    """Sum of the squares of every element of `pieces`, accumulated in float64."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in pieces:
        # Accumulated in float64 inside the reduction: `.double().pow(2)` made two
        # float64 copies of every gradient (4.2 GB at once for a 262M-entry embedding)
        # and took twice as long on a CPU thread (50M bf16: 409 ms against 190).
        total += torch.linalg.vector_norm(g, dtype=torch.float64).square()
    return total.item()


def global_norm(local_squared_sum: float, groups: Sequence[ScalarGroup]) -> float:
    """The norm of the whole gradient: this rank's squared sum added over each of
    `groups` in turn (the groups the gradient is split over, each once)."""
    sq = local_squared_sum
    for group in groups:
        sq = group.all_reduce_scalars([sq])[0]
    return math.sqrt(sq)


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """What to multiply the gradients by so their norm is at most `max_norm`: as
    torch.nn.utils.clip_grad_norm_, max_norm / (norm + 1e-6) capped at 1.0; 1.0
    (leave them) when max_norm is None."""
    if max_norm is None:
        return 1.0
    return min(max_norm / (norm + 1e-6), 1.0)
