"""Deterministic initialisation keyed by parameter *name*, materialisable slice by slice.

Every parameter's values are a pure function of (model seed, global parameter name,
global shape). The flattened parameter is cut into fixed chunks of CHUNK elements and
chunk k is drawn from a generator seeded by (seed, name, k). So any rank can build just
its shard — a row block for tensor parallelism, a flat 1/N slice for ZeRO-3 — and get
exactly the same numbers as the same slice of a single-device model, without ever
holding the whole model. Only chunks that overlap the slice are drawn.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

CHUNK = 1 << 16


@dataclass(frozen=True)
class InitRule:
    """How one parameter is drawn: 'normal' (mean 0, std), 'ones' or 'zeros'."""

    kind: str
    std: float = 0.0


@dataclass(frozen=True)
class ParamInit:
    """A model's whole initialisation: `rule(global name) -> InitRule`, and the seed.

    It is all parallel code needs to draw any slice of any parameter, so it reads a
    model's initialisation through this object (carried by the model's plan) and never
    imports the model.
    """

    rule: Callable[[str], InitRule]
    seed: int

    def flat_slice(self, name: str, start: int, stop: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return init_flat_slice(self.rule(name), self.seed, name, start, stop, dtype)

    def full(self, name: str, shape: tuple[int, ...],
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return init_full(self.rule(name), self.seed, name, shape, dtype)

    def slice(self, name: str, shape: tuple[int, ...], dim: int, start: int, stop: int,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return init_slice(self.rule(name), self.seed, name, shape, dim, start, stop, dtype)


@torch.no_grad()
def init_parameters(model: torch.nn.Module, init: ParamInit) -> None:
    """Fill every parameter of a materialised model from its global name."""
    for name, param in model.named_parameters():
        param.copy_(init.full(name, tuple(param.shape)).to(param.dtype))


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_flat_slice(rule: InitRule, seed: int, name: str, start: int, stop: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elements [start, stop) of the flattened parameter `name`, drawn as in a full init."""
    n = stop - start
    if rule.kind == "ones":
        return torch.ones(n, dtype=dtype)
    if rule.kind == "zeros":
        return torch.zeros(n, dtype=dtype)
    out = torch.empty(n, dtype=torch.float64)
    first, last = start // CHUNK, (stop - 1) // CHUNK if n else -1
    gen = torch.Generator()
    for k in range(first, last + 1):
        gen.manual_seed(_chunk_seed(seed, name, k))
        # Always draw the whole chunk so its values do not depend on the slice asked for.
        chunk = torch.randn(CHUNK, generator=gen, dtype=torch.float64)
        lo, hi = max(start, k * CHUNK), min(stop, (k + 1) * CHUNK)
        out[lo - start:hi - start] = chunk[lo - k * CHUNK:hi - k * CHUNK]
    return (out * rule.std).to(dtype)


def init_full(rule: InitRule, seed: int, name: str, shape: tuple[int, ...],
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    numel = math.prod(shape)
    return init_flat_slice(rule, seed, name, 0, numel, dtype).view(shape)


def init_slice(rule: InitRule, seed: int, name: str, shape: tuple[int, ...],
               dim: int, start: int, stop: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, stop) of parameter `name` of `shape`.

    Row slices of a row-major tensor are contiguous and draw only the chunks they touch;
    column slices draw the full parameter once and cut it (one parameter, never a model).
    """
    if dim == 0:
        row = math.prod(shape[1:])
        flat = init_flat_slice(rule, seed, name, start * row, stop * row, dtype)
        return flat.view(stop - start, *shape[1:])
    return init_full(rule, seed, name, shape, dtype).narrow(dim, start, stop - start).clone()
