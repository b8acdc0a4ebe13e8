"""Dynamic loss scaling for float16, agreed on by every rank.

Overflow is decided from a flag all-reduced (MAX) over every rank that holds gradients
of the model, so one rank's inf skips the step everywhere and no rank waits for a
collective another skipped.
"""

from __future__ import annotations

from partita.errors import PartitaError
from partita.zero.policies import MixedPrecision


class LossScaler:
    def __init__(self, policy: MixedPrecision) -> None:
        self.enabled = policy.loss_scaling
        self.scale = policy.initial_scale if self.enabled else 1.0
        self.growth_interval = policy.growth_interval
        self.max_skips = policy.max_skips
        self.clean_steps = 0
        self.skips = 0  # consecutive

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.skips += 1
            self.clean_steps = 0
            self.scale = max(self.scale / 2, 1.0)
            if self.skips >= self.max_skips:
                raise PartitaError(
                    f"float16 gradients overflowed on {self.skips} consecutive steps (loss "
                    f"scale now {self.scale:g}); training cannot make progress. Lower the "
                    "learning rate (--train.lr), clip gradients (--train.grad_clip=1.0), "
                    "or train in bfloat16 (--precision.param_dtype=bfloat16), whose range "
                    "does not need loss scaling. If the loss itself is inf or nan, check "
                    "the data and the initialisation first."
                )
            return
        self.skips = 0
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skips": self.skips,
                "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        """Take a saved run's scaling state only when both runs scale the loss. A float16
        checkpoint resumed in bfloat16 or float32 keeps scale 1 (a saved 65536 would
        multiply the loss with nothing dividing it out again); a bfloat16 or float32
        one resumed in float16 starts from the initial scale, not the saved 1 (which
        would grow back only after thousands of clean steps)."""
        # Checkpoints written before "enabled" was saved: a scaler that was off never
        # counted a clean step nor moved from 1.
        saved_enabled = state.get("enabled", state["clean_steps"] > 0 or state["scale"] != 1.0)
        if not (self.enabled and saved_enabled):
            return
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
        self.skips = state["skips"]
