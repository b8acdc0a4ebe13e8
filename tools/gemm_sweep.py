"""Measured GEMM and flash-attention rates against the planner's kernel model.

    python tools/gemm_sweep.py --device cuda --gpu-type H200 --json sweep.json
    PYTHONPATH=src python tools/gemm_sweep.py --device cpu --scale 16   # a smoke run

`partita.planner.compute` times a block kernel by kernel from its shape: a large-GEMM
rate (`gemm_peak_fraction` of datasheet peak), whole output tiles (`gemm_tile`), an
inner-dimension effect K / (K + `gemm_k_half`), and flash attention at a fraction of the
GEMM rate. This measures each of those on the device and prints, per shape, the measured
TFLOP/s, the planner's prediction for the same shape and their ratio:

* square products n x n x n (the large-GEMM rate);
* M = N = 8192 with K from 16 up (the inner-dimension effect);
* N just above and below multiples of 128 (tile quantisation);
* the forward and weight-gradient GEMMs of transformer blocks of hidden 1024-16384 at
  tp 1 and 8, 8192 tokens (what the validation table's runs compute);
* causal flash attention forward and forward + backward (`scaled_dot_product_attention`).

Each time is the median of 7 timings of a batch of calls (CUDA events on a GPU), after
warm-up, on normal random data. `--scale S` divides every dimension by S (a CPU smoke
run of the same code). The last line fits the constants the planner would use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from partita.planner.assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from partita.planner.compute import gemm_fraction, gemm_time
from partita.planner.hardware import get_gpu

TOKENS = 8192
HIDDENS = (1024, 2048, 4096, 8192, 12288, 16384)


def timed(fn, device: torch.device, target_s: float = 0.02) -> float:
    """Seconds per call of `fn`: median of 7 batches, each long enough to dwarf launch
    latency (about `target_s`)."""
    cuda = device.type == "cuda"

    def batch(n: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    for _ in range(2):
        fn()
    one = batch(1)
    n = max(1, min(200, round(target_s / max(one, 1e-7))))
    return statistics.median(batch(n) for _ in range(7))


def gemm_row(kind: str, m: int, n: int, k: int, device, dtype, gpu, a: Assumptions) -> dict:
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(k, n, device=device, dtype=dtype)
    seconds = timed(lambda: torch.mm(x, w), device)
    flops = 2.0 * m * n * k
    predicted = gemm_time(m, n, k, gpu, a, elem_bytes=x.element_size()) if gpu else 0.0
    return {"kind": kind, "m": m, "n": n, "k": k, "seconds": seconds,
            "tflops": flops / seconds / 1e12,
            "predicted_tflops": flops / predicted / 1e12 if predicted else 0.0}


def attention_row(kind: str, b: int, heads: int, s: int, d: int, device, dtype, gpu,
                  a: Assumptions) -> dict:
    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(b, heads, s, d, device=device, dtype=dtype)

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both():
        torch.autograd.grad(forward(), (q, k, v), grad)

    flops_fwd = 4.0 * b * heads * s * s * d * 0.5  # causal: half the scores
    fwd = timed(forward, device)
    total = timed(both, device)
    row = {"kind": kind, "b": b, "heads": heads, "s": s, "d": d,
           "fwd_tflops": flops_fwd / fwd / 1e12,
           "bwd_tflops": 2.5 * flops_fwd / max(total - fwd, 1e-9) / 1e12}
    if gpu:  # the planner's rate: the GEMM rate at K = d, times the flash fractions
        rate = gpu.peak_flops * gemm_fraction(gpu, a) * d / (d + a.gemm_k_half)
        row["predicted_fwd_tflops"] = rate * a.flash_fwd_fraction / 1e12
        row["predicted_bwd_tflops"] = rate * a.flash_bwd_fraction / 1e12
    return row


def shapes(scale: int) -> list[tuple[str, int, int, int]]:
    def s(x: int) -> int:
        return max(1, x // scale)

    out = [("square", s(n), s(n), s(n)) for n in (1024, 2048, 4096, 8192, 16384)]
    out += [("inner", s(8192), s(8192), max(1, k // scale))
            for k in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)]
    out += [("tile", s(8192), s(8192) + d, s(8192)) for d in (-1, 1, 64, 127)]
    for h in HIDDENS:
        for tp in (1, 8):
            t, hh, ffn = s(TOKENS), s(h), s(4 * h)
            # forward (m, n, k): qkv, attention out, MLP up, MLP down; then the weight
            # gradient of the largest one, whose inner dimension is the token count.
            out += [(f"block h={h} tp={tp}", t, 3 * hh // tp, hh),
                    (f"block h={h} tp={tp}", t, hh, hh // tp),
                    (f"block h={h} tp={tp}", t, ffn // tp, hh),
                    (f"block h={h} tp={tp}", t, hh, ffn // tp),
                    (f"wgrad h={h} tp={tp}", hh, ffn // tp, t)]
    return out


def fit_summary(rows: list[dict]) -> dict:
    """The constants the planner would take from these rows."""
    # Squares of 4096 and up (below that a product is short enough to sit in L2 and
    # under the sustained clock), or whatever squares a scaled-down run has.
    square = [r for r in rows if r["kind"] == "square"]
    large = statistics.median(r["tflops"] for r in (
        [r for r in square if r["m"] >= 4096] or square))
    inner = {r["k"]: r["tflops"] / large for r in rows if r["kind"] == "inner"}
    # K / (K + k_half) = rate  =>  k_half = K (1 - rate) / rate, over the K that show it.
    k_halves = [k * (1 - f) / f for k, f in inner.items() if 0.05 < f < 0.95]
    blocks = [r["tflops"] / r["predicted_tflops"] for r in rows
              if r["kind"].startswith(("block", "wgrad")) and r["predicted_tflops"]]
    return {"large_gemm_tflops": large,
            "gemm_k_half": statistics.median(k_halves) if k_halves else 0.0,
            "block_measured_over_predicted": (statistics.median(blocks) if blocks else 0.0,
                                              min(blocks, default=0.0),
                                              max(blocks, default=0.0))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-type", default="", help="planner GPU to predict for (e.g. H200)")
    p.add_argument("--scale", type=int, default=1, help="divide every dimension by this")
    p.add_argument("--json", default="", help="write every row here")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(1)
    gpu = get_gpu(args.gpu_type) if args.gpu_type else None
    a = DEFAULT_ASSUMPTIONS
    rows = []
    print(f"{'kind':>18} {'m':>6} {'n':>6} {'k':>6} {'TFLOP/s':>8} {'planner':>8} {'ratio':>6}")
    for kind, m, n, k in shapes(args.scale):
        r = gemm_row(kind, m, n, k, device, dtype, gpu, a)
        rows.append(r)
        ratio = r["tflops"] / r["predicted_tflops"] if r["predicted_tflops"] else 0.0
        print(f"{kind:>18} {m:>6} {n:>6} {k:>6} {r['tflops']:>8.1f} "
              f"{r['predicted_tflops']:>8.1f} {ratio:>6.2f}", flush=True)
        if device.type == "cuda":  # each shape's operands are freed before the next
            torch.cuda.empty_cache()
    print(f"{'flash (causal)':>18} {'b':>3} {'heads':>5} {'s':>5} {'d':>4} "
          f"{'fwd':>7} {'planner':>7} {'bwd':>7} {'planner':>7}")
    for b, heads, s, d in ((4, 32, 2048, 64), (4, 32, 2048, 128), (1, 32, 8192, 128),
                           (2, 64, 4096, 128)):
        s = max(8, s // args.scale)
        r = attention_row("flash", b, heads, s, d, device, dtype, gpu, a)
        rows.append(r)
        print(f"{'':>18} {b:>3} {heads:>5} {s:>5} {d:>4} {r['fwd_tflops']:>7.1f} "
              f"{r.get('predicted_fwd_tflops', 0):>7.1f} {r['bwd_tflops']:>7.1f} "
              f"{r.get('predicted_bwd_tflops', 0):>7.1f}", flush=True)
    summary = fit_summary([r for r in rows if "tflops" in r])
    peak = f" = {summary['large_gemm_tflops'] * 1e12 / gpu.peak_flops:.3f} of peak" \
        if gpu else ""
    med, lo, hi = summary["block_measured_over_predicted"]
    print(f"sweep: large GEMMs {summary['large_gemm_tflops']:.1f} TFLOP/s{peak}; "
          f"gemm_k_half {summary['gemm_k_half']:.0f}; block GEMMs measured/predicted "
          f"median {med:.2f} ({lo:.2f}-{hi:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "dtype": args.dtype,
                       "name": torch.cuda.get_device_name(0) if device.type == "cuda"
                       else "cpu", "torch": torch.__version__, "rows": rows,
                       "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
