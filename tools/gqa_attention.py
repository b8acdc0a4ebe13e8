"""Attention forward + backward with grouped kv heads: read in place by the kernel
(`enable_gqa`, what partita's core does on CPU) against repeated to the query heads.

    PYTHONPATH=src python tools/gqa_attention.py [--steps 50]

One thread, fp32, causal `scaled_dot_product_attention`; the median of `--steps` timed
calls after five warm-up ones, for a few (batch, query heads, kv heads, seq, head size)
shapes, each pair run twice.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from partita.models.transformer import repeat_kv_heads

SHAPES = [(4, 4, 2, 128, 32), (4, 8, 2, 128, 32), (1, 32, 8, 256, 64)]


def time_attention(native: bool, shape: tuple[int, ...], steps: int) -> float:
    """Median microseconds of one forward + backward."""
    b, h, g, s, d = shape
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = (torch.randn(b, g, s, d, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(b, h, s, d)

    def once() -> None:
        if native:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, *repeat_kv_heads(k, v, h), is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad_out)

    for _ in range(5):
        once()
    took = []
    for _ in range(steps):
        t0 = time.perf_counter()
        once()
        took.append(time.perf_counter() - t0)
    return statistics.median(took) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for shape in SHAPES:
        for _ in range(2):
            rep, nat = (time_attention(n, shape, args.steps) for n in (False, True))
            print(f"(b, h, kv, s, d) = {shape}: repeated {rep:7.0f} us, in place {nat:7.0f} us,"
                  f" ratio {nat / rep:.3f}")


if __name__ == "__main__":
    main()
