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


# On a CPU the norm of each row of this many elements is taken in the gradient's own
# precision (float32 or float64), and the rows' squares added in float64. A whole-tensor
# reduction in float32 drifted 1e-3 from the float64 sum over 20M elements; rows of 4096
# keep each partial sum short (2e-7 there). Asking the reduction itself to accumulate in
# float64 (`vector_norm(g, dtype=torch.float64)`) converts element by element on a CPU:
# 213 ms for 20M float32 elements on one thread against 15 ms, the whole gap to torch's
# own clipping on a 20M-parameter model. A GPU's reduction casts as it reads, at memory
# speed, and keeps that simpler form.
ROW = 4096
# On a CPU, gradients in a narrower dtype (bf16, fp16) are cast to float64 in chunks of
# this many elements first: asking the reduction to cast ran 3-5x slower, and a
# whole-gradient cast is a fresh allocation, page-faulted on every step.
CAST_CHUNK = 1 << 18


def squared_sum(pieces: Iterable[torch.Tensor], device: torch.device) -> float:
    """Sum of the squares of every element of `pieces`, accumulated in float64 (on a
    CPU across rows of ROW elements, see ROW)."""
    if torch.device(device).type != "cpu":
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g in pieces:
            total += torch.linalg.vector_norm(g, dtype=torch.float64).square()
        return total.item()
    norms: list[torch.Tensor] = []
    scratch: torch.Tensor | None = None
    for g in pieces:
        g = g.reshape(-1)
        if g.dtype in (torch.float32, torch.float64):
            norms += _row_norms(g)
            continue
        if scratch is None:
            scratch = torch.empty(CAST_CHUNK, dtype=torch.float64, device=device)
        for lo in range(0, g.numel(), scratch.numel()):
            part = g[lo:lo + scratch.numel()]
            norms += _row_norms(scratch[:part.numel()].copy_(part))
    if not norms:
        return 0.0
    return torch.cat(norms).double().square().sum().item()


def _row_norms(g: torch.Tensor) -> list[torch.Tensor]:
    """Norms of `g`'s rows of ROW elements and of the rest (a 1-D tensor each)."""
    rows = g.numel() // ROW
    out = []
    if rows:
        out.append(torch.linalg.vector_norm(g[:rows * ROW].view(rows, ROW), dim=1))
    if g.numel() % ROW:
        out.append(torch.linalg.vector_norm(g[rows * ROW:]).reshape(1))
    return out


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
