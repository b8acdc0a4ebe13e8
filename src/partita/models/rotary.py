"""Rotary position embedding: its frequencies and tables, and the rotations of q and k.

Pairs of a head's features rotate by position-dependent angles. Eager code rotates the
pairs side by side as complex products (`rotate_pairs`); compiled attention with plain
q and k projections reorders the projections' weight rows so that the pairs come out as
each head's two halves, and rotates those (`rotate_halves`, `pairs_as_halves`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from partita.eager_only import trace_time_constant
from partita.models.model_config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The rotary inverse frequencies (head_dim/2, float64), with cfg's RoPE scaling.

    Llama 3.1's scaling keeps wavelengths shorter than original_max_len/high_freq_factor,
    divides those longer than original_max_len/low_freq_factor by `factor`, and blends
    the two linearly in 1/wavelength between (the published formula, computed in float64).
    """
    inv_freq = _unscaled_frequencies(cfg.rope_theta, cfg.head_dim)
    if cfg.rope_scaling != "llama3":
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _unscaled_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    """theta^(-2i/head_dim) for i < head_dim/2, float64, on the CPU (even inside a
    meta-device build)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    return 1.0 / theta ** (steps / head_dim)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device, dtype,
                  offset: int | torch.Tensor = 0, inv_freq: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim/2) for positions offset..offset+seq_len.

    `offset` may also be a tensor holding all seq_len positions: a context-parallel shard
    holds chunks of the sequence that are not contiguous. `inv_freq` (float64, see
    rope_frequencies) overrides the unscaled frequencies of theta.
    """
    if inv_freq is None:
        inv_freq = _unscaled_frequencies(theta, head_dim)
    if isinstance(offset, torch.Tensor):
        pos = offset.to("cpu", torch.float64)
    else:
        pos = torch.arange(offset, offset + seq_len, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


@trace_time_constant
def rotary_constants(seq_len: int, offset: int, inv_freq: tuple[float, ...],
                     device: torch.device, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_tables` for contiguous positions, from plain values: compiled code takes
    its result as a constant (see partita.eager_only), where traced it recomputed the
    float64 cos and sin inside every kernel reading them (a compiled tiny-model block,
    CPU: 58 -> 47 ms per step). The frequencies travel as floats, exactly the float64
    values of `rope_frequencies`, so the tables are bitwise the same."""
    freqs = torch.tensor(inv_freq, dtype=torch.float64)
    return rotary_tables(seq_len, 2 * len(inv_freq), 0.0, device, dtype, offset, freqs)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (batch, seq, heads, head_dim)."""
    return rotate_pairs((x,), cos, sin)[0]


def rotate_pairs(xs: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    """`apply_rotary` on each of `xs` with one table.

    Eager float32/float64 rotates as one complex product per tensor, (x[2i] + i x[2i+1])
    (cos + i sin): the same two products and a sum per element as the real form, one
    operation instead of eight, with one saved table for all of `xs` (cos and sin's
    bytes). The tiny model's rotary embedding of q and k, forward + backward, one CPU
    thread: 0.50 ms per layer against 1.29. Eager 16-bit tensors (no complex bf16 on a
    CPU) rotate in float32 the same way (`RotateInFloat32`), rounding once: 0.34 ms
    against the real form's 1.28 in bf16. Compiled attention whose q and k projections
    apply their weights directly (`plain_projection`) rotates halves instead
    (`rotate_halves`); other compiled code keeps the real form, which inductor fuses,
    and so do layouts whose pairs are not adjacent in memory."""
    if not torch.compiler.is_compiling():
        if all(_pairs_adjacent(x) for x in xs):
            rot = torch.complex(cos, sin)[None, :, None, :]
            return tuple(torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2)))
                                            * rot).flatten(-2) for x in xs)
        if all(x.dtype in (torch.bfloat16, torch.float16) for x in xs):
            return RotateInFloat32.apply(cos, sin, *xs)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return tuple(torch.stack(_rotated(x[..., 0::2], x[..., 1::2], cos, sin), dim=-1).flatten(-2)
                 for x in xs)


def rotate_halves(xs: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
    """`rotate_pairs` for tensors whose pairs are stored as the two halves of each head,
    (x[i], x[i + head_dim/2]) (`pairs_as_halves`): contiguous slices that compiled
    code vectorizes, where the pairs side by side take strided loads and stores."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return tuple(torch.cat(_rotated(*x.chunk(2, dim=-1), cos, sin), dim=-1) for x in xs)


def _rotated(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (x1, x2) rotated by the angles of cos and sin, in the real form."""
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


def pairs_as_halves(linear: nn.Module, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`linear(x)` with each head's output features reordered from pairs side by side
    to halves: even features first, then odd ones. Attention reads q and k only through
    their dot products, which one reordering of both leaves unchanged, so the rotated
    q and k need no reordering back. Reordering the weight's rows (whole rows, cheap)
    instead of the output keeps the stored layout as it is. The tiny model's compiled
    step on a CPU: 0.96-0.98 of the time with the pairs side by side in bf16, 0.98 in
    fp32 (docs/benchmarks.md, "Rotary pairs as halves in compiled attention")."""
    enter = getattr(linear, "linear_input", None)
    return _HalvesLinear.apply(x if enter is None else enter(x), linear.weight, linear.bias,
                               head_dim)


def _halves(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows (features) of t reordered per head: pairs side by side -> halves."""
    return t.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2)


def _pairs(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `_halves`."""
    return t.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


class _HalvesLinear(torch.autograd.Function):
    """F.linear with the weight's rows reordered by `_halves`, reordering them again in
    backward rather than saving the reordered copy: compiled, the copy was kept for
    backward, (dim + kv_dim) x dim values a layer (1.3 GB for Llama 3 8B in bf16)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                head_dim: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.head_dim = head_dim
        return F.linear(x, _halves(weight, head_dim),
                        None if bias is None else _halves(bias, head_dim))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        rows = grad.flatten(0, -2)
        grad_x = grad_w = grad_b = None
        # Casts for autocast, whose forward GEMM ran in a lower precision than x and
        # the weight: each gradient in its input's dtype.
        if need_x:
            # A gather rather than `_halves`' copy: the compiler would take the
            # backward's copy for the forward's and keep that one alive in between.
            order = _halves(torch.arange(weight.shape[0], device=weight.device),
                            ctx.head_dim)
            grad_x = (grad @ weight.index_select(0, order).to(grad.dtype)).to(x.dtype)
        if need_w:
            grad_w = _pairs(rows.t() @ x.flatten(0, -2).to(grad.dtype),
                            ctx.head_dim).to(weight.dtype)
        if need_b:
            grad_b = _pairs(rows.sum(0), ctx.head_dim).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


def plain_projection(module: nn.Module) -> bool:
    """A projection without hooks whose forward is F.linear of its own weight and bias,
    on its input as it is (nn.Linear) or as its `linear_input` makes it (a tensor-
    parallel column shard, whose rows hold whole heads): `pairs_as_halves` may apply
    them itself."""
    return ((type(module) is nn.Linear or callable(getattr(module, "linear_input", None)))
            and not module._forward_pre_hooks and not module._forward_hooks)


class RotateInFloat32(torch.autograd.Function):
    """Rotary embedding of 16-bit tensors as float32 complex products, rounded back once.

    The rotation is linear in x, so backward rotates the gradient by the conjugate and
    nothing but the (complex) table is saved: the real form keeps x itself for its
    products. forward(cos, sin, *xs) -> the rotated xs, each in its own dtype."""

    @staticmethod
    def forward(ctx, cos: torch.Tensor, sin: torch.Tensor, *xs: torch.Tensor):
        rot = torch.complex(cos.float(), sin.float())[None, :, None, :]
        ctx.save_for_backward(rot)
        return tuple(_rotate_float32(x, rot) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        (rot,) = ctx.saved_tensors
        conj = rot.conj()
        return (None, None, *(_rotate_float32(g, conj) for g in grads))


def _rotate_float32(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    pairs = x.to(torch.float32, memory_format=torch.contiguous_format).unflatten(-1, (-1, 2))
    return torch.view_as_real(torch.view_as_complex(pairs) * rot).flatten(-2).to(x.dtype)


def _pairs_adjacent(x: torch.Tensor) -> bool:
    """Whether x can be viewed as complex numbers: float32/64, pairs side by side."""
    return (x.dtype in (torch.float32, torch.float64) and x.stride(-1) == 1
            and x.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in x.stride()[:-1]))
