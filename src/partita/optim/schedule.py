"""The learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math
from dataclasses import dataclass

from partita.errors import PartitaError


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warm-up to `lr` over the first `warmup_steps` steps (step 0 already takes
    lr / warmup_steps), then cosine decay that reaches `min_lr` at step `total_steps`
    and stays there. Steps count from 0."""

    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise PartitaError(
                f"train.warmup_steps={self.warmup_steps} must be >= 0: the number of "
                "steps over which the learning rate rises linearly to train.lr."
            )

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))
