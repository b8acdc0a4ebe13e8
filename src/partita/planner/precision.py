"""The precision policy a layout trains under: bytes per parameter of each model state.

Layouts themselves are `partita.layout.Layout`, the one type the config, the trainer and
the planner share.
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.errors import PartitaError


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state (Adam keeps two moments).

    Default: bf16 parameters and gradients with fp32 master weights and fp32 Adam
    moments, the 2 + 2 + 4 + 8 = 16 bytes of the ZeRO paper. `fp32()` trains in fp32
    with no separate master copy: 4 + 4 + 0 + 8. `grad` is the dtype gradients are held
    in, which is the reduce dtype where that is wider: bf16 parameters with fp32
    reductions (`precision.reduce_dtype = "float32"`) are `Precision(grad=4)`, 18 bytes.
    """

    param: int = 2
    grad: int = 2
    master: int = 4
    optimizer: int = 8
    activation: int = 2  # bytes per activation element saved for backward

    @classmethod
    def fp32(cls) -> Precision:
        return cls(param=4, grad=4, master=0, optimizer=8, activation=4)

    @classmethod
    def named(cls, name: str) -> Precision:
        if name in ("bf16", "fp16", "mixed"):
            return cls()
        if name == "bf16-fp32-grads":  # fp32 reductions and accumulation (Megatron-LM's bf16)
            return cls(grad=4)
        if name == "fp32":
            return cls.fp32()
        raise PartitaError(f"unknown precision '{name}'; use {', '.join(NAMES)}.")

    @property
    def name(self) -> str:
        """The `--precision` name of this policy ("custom" for one no name gives)."""
        return next((n for n in NAMES if Precision.named(n) == self), "custom")

    @property
    def total(self) -> int:
        return self.param + self.grad + self.master + self.optimizer


NAMES = ("bf16", "bf16-fp32-grads", "fp32")  # what `partita plan --precision` accepts
MIXED = Precision()  # the default policy (immutable, shared as a default argument)
