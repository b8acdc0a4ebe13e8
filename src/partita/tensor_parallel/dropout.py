"""Dropout masks under tensor parallelism: identical where activations are replicated,
different where they are split.

The rule: a dropout mask must be the one a single device would draw for the *whole*
tensor, i.e. the same across tp ranks for a replicated activation (the residual stream
without sequence parallelism: ranks that disagreed would hold different "replicated"
activations and silently diverge), and independent across tp ranks for an activation
whose ranks hold different pieces (attention heads, MLP hidden shards, and every
sequence-sharded activation under sequence parallelism: equal masks there would repeat
one pattern across heads or sequence chunks).

`RegionRNG` holds one generator per kind, seeded from the run's dropout seed (which the
caller makes differ across data-parallel ranks) and, for the split kind, the tp index.
`apply_tensor_parallel` replaces every nn.Dropout by a `ParallelDropout` bound to the
right generator: split inside a tensor-parallel region (a module whose children are
column-parallel) or anywhere under sequence parallelism, replicated otherwise.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class RegionRNG:
    """Generators for replicated and for tp-split activations, one per device."""

    def __init__(self, seed: int, tp_index: int) -> None:
        self.seeds = {"replicated": _seed(seed, "replicated"),
                      "split": _seed(seed, "split", tp_index)}
        self._gens: dict[tuple[str, str], torch.Generator] = {}

    def generator(self, kind: str, device: torch.device) -> torch.Generator:
        key = (kind, str(device))
        gen = self._gens.get(key)
        if gen is None:
            gen = self._gens[key] = torch.Generator(device=device)
            gen.manual_seed(self.seeds[kind])
        return gen


class ParallelDropout(nn.Module):
    """Inverted dropout drawing its mask from a RegionRNG generator of one kind."""

    def __init__(self, p: float, rng: RegionRNG, kind: str) -> None:
        super().__init__()
        self.p, self.rng, self.kind = p, rng, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p,
                                              generator=self.rng.generator(self.kind, x.device))
        return x * keep / (1.0 - self.p)

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator this dropout draws from on `device` (recomputation restores it)."""
        return self.rng.generator(self.kind, device)

    def checkpointed_generators(self, device: torch.device) -> dict[str, torch.Generator]:
        """The random stream this module draws from, by a name that is the same on every
        run of the layout (checkpoints save and restore it)."""
        return {f"tp_dropout/{self.kind}": self.generator(device)}

    def extra_repr(self) -> str:
        return f"p={self.p}, masks {self.kind} over tp"
