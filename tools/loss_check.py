"""partita.loss against torch's cross-entropy: time and peak memory of forward + backward.

    python tools/loss_check.py [--tokens 8192 --vocab 128256 --dtype bfloat16]

On a GPU: CUDA events around each run, `torch.cuda.max_memory_allocated` above the
inputs; on a CPU (a smoke run): wall time only. The logits come from a head matmul so
that their lifetime is the model's (dropped once the loss has them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from partita.loss import cross_entropy


def torch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)


def run(fn, h, w, targets, cuda: bool) -> tuple[float, int]:
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    logits = F.linear(h, w)
    loss = fn(logits, targets)
    del logits
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    took = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    h.grad = w.grad = None
    return took, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(args.tokens, args.dim, device=device, generator=gen).to(dtype)
    w = (torch.randn(args.vocab, args.dim, device=device, generator=gen) * 0.02).to(dtype)
    h.requires_grad_(), w.requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=gen)
    results = {"torch": [], "partita": []}
    for fn in (torch_loss, cross_entropy):
        run(fn, h, w, targets, cuda)  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("torch", torch_loss), ("partita", cross_entropy)):
            results[name].append(run(fn, h, w, targets, cuda))
    logits = args.tokens * args.vocab
    print(f"loss: {args.tokens} tokens x {args.vocab} vocab x {args.dim} dim, {args.dtype}, "
          f"{device.type}; head matmul + loss, forward + backward, median of {args.repeats}")
    for name, rows in results.items():
        ms = statistics.median(t for t, _ in rows) * 1e3
        peak = max(p for _, p in rows)
        print(f"{name:>8}: {ms:8.2f} ms" + (f", peak {peak / 1e9:.2f} GB "
                                            f"({peak / logits:.1f} bytes per logit)"
                                            if cuda else ""))
    t = {k: statistics.median(x for x, _ in v) for k, v in results.items()}
    print(f"loss: partita/torch time ratio {t['partita'] / t['torch']:.3f}")


if __name__ == "__main__":
    main()
