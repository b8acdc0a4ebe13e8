"""Attention forward + backward with grouped kv heads: read in place by the kernel
(`enable_gqa`, what partita's core does on CPU) against repeated to the query heads.

    PYTHONPATH=src python tools/gqa_attention.py [--steps 50]
    PYTHONPATH=src python tools/gqa_attention.py --device cuda --dtype bfloat16

Causal `scaled_dot_product_attention`; the median of `--steps` timed calls after five
warm-up ones, for a few (batch, query heads, kv heads, seq, head size) shapes, each pair
run twice. On the CPU one thread. On CUDA it also forces each SDPA backend in turn with
the kv heads in place and says which take them (a backend that cannot refuses with "No
available kernel") and how fast: SDPA's own choice falls back to the math kernel where
no fused one takes grouped heads, which is why partita's CUDA core still repeats them
(`partita.models.transformer.AttentionCore`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from partita.models.transformer import repeat_kv_heads

CPU_SHAPES = [(4, 4, 2, 128, 32), (4, 8, 2, 128, 32), (1, 32, 8, 256, 64)]
# Llama 3.2 1B's attention at partita's GPU benchmark batch (4 x 2048 tokens), and Llama
# 3 8B's heads at one sequence of 8192.
CUDA_SHAPES = [(4, 32, 8, 2048, 64), (1, 32, 8, 8192, 128)]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def time_attention(native: bool, shape: tuple[int, ...], steps: int, device: str,
                   dtype: torch.dtype, backend: SDPBackend | None = None) -> float:
    """Median microseconds of one forward + backward; raises RuntimeError where the
    forced `backend` cannot run it."""
    b, h, g, s, d = shape
    make = dict(device=device, dtype=dtype)
    q = torch.randn(b, h, s, d, requires_grad=True, **make)
    k, v = (torch.randn(b, g, s, d, requires_grad=True, **make) for _ in range(2))
    grad_out = torch.randn(b, h, s, d, **make)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def once() -> None:
        if native:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, *repeat_kv_heads(k, v, h), is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad_out)

    backends = [backend] if backend is not None else list(BACKENDS.values())
    with sdpa_kernel(backends):
        for _ in range(5):
            once()
        took = []
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            once()
            sync()
            took.append(time.perf_counter() - t0)
    return statistics.median(took) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        default="float32")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    dtype = getattr(torch, args.dtype)
    if args.device == "cpu":
        torch.set_num_threads(1)
    print(f"{args.device}, {args.dtype}: forward + backward, median of {args.steps} calls")
    for shape in CPU_SHAPES if args.device == "cpu" else CUDA_SHAPES:
        for _ in range(2):
            rep, nat = (time_attention(n, shape, args.steps, args.device, dtype)
                        for n in (False, True))
            print(f"(b, h, kv, s, d) = {shape}: repeated {rep:7.0f} us, in place {nat:7.0f} us,"
                  f" ratio {nat / rep:.3f}", flush=True)
        if args.device != "cuda":
            continue
        for name, backend in BACKENDS.items():
            try:
                us = time_attention(True, shape, args.steps, args.device, dtype, backend)
                print(f"  in place, {name:9} forced: {us:7.0f} us", flush=True)
            except RuntimeError as err:
                print(f"  in place, {name:9} forced: refused ({str(err).splitlines()[0]})",
                      flush=True)


if __name__ == "__main__":
    main()
