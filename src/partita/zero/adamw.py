"""AdamW on flat slices: one set of tensor ops per bucket instead of one per parameter.

Element for element this is torch.optim.AdamW (decoupled weight decay, bias correction,
eps added after the square root), so a float64 run matches the torch optimizer to
rounding. Weight decay touches only the ranges of parameters with ndim >= 2.
"""

from __future__ import annotations

import torch

from partita.zero.config import AdamWConfig
from partita.zero.flat import FlatBuffer


def decay_ranges(flat: FlatBuffer, lo: int, hi: int) -> list[tuple[int, int]]:
    """Ranges, relative to `lo`, of elements in [lo, hi) that get weight decay (merged)."""
    out: list[tuple[int, int]] = []
    for pc in flat.pieces(lo, hi):
        if not pc.entry.decays:
            continue
        a = pc.buf_start - lo
        b = a + pc.stop - pc.start
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


@torch.no_grad()
def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
           exp_avg_sq: torch.Tensor, step: int, lr: float, cfg: AdamWConfig,
           decay: list[tuple[int, int]]) -> None:
    """One AdamW update of the flat `param` in place (step counts from 1)."""
    beta1, beta2 = cfg.betas
    if cfg.weight_decay:
        for a, b in decay:
            param[a:b].mul_(1 - lr * cfg.weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(cfg.eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
