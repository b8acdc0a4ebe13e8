"""The planner's CPU step-time model against this machine: attention kernel and whole steps.

    PYTHONPATH=src python tools/cpu_step_model.py attention
    PYTHONPATH=src python tools/cpu_step_model.py steps [--rounds 2]

`attention`: torch's CPU flash kernel (causal, one thread) forward and backward at a few
shapes, as a fraction of the GEMM rate the planner would give it (the profile's matmul
rate x the preset's gemm_peak_fraction x hd/(hd + gemm_k_half)): what
`planner.assumptions.CPU_FLASH` holds.

`steps`: partita's stage 0 on one gloo rank (fp32, one thread), eager and with compiled
blocks, at several model sizes and batches, each the median of 10 timed steps, against
`partita plan`'s step time on the `cpu` profile measured just before
(`Assumptions.measured_cpu()`). Rounds
repeat the profile and the cases, so a slow spell of a shared machine shows as a
round that differs. A diagnostic beside `partita bench plan-accuracy`, which runs the
test suite's layouts at one small size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from partita.bench.plan_measure import Case, Shape, measure_cases, predict
from partita.local_world import run_distributed

TINY = Shape(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, seq_len=128)
WIDE = Shape(dim=512, n_layers=4, n_heads=8, n_kv_heads=None, vocab_size=8192, seq_len=128)
CASES = [Case(shape=Shape(), mb=2), Case(shape=TINY, mb=1), Case(shape=TINY, mb=4),
         Case(shape=TINY, mb=8), Case(shape=WIDE, mb=4), Case(shape=TINY, mb=4, dtype="bfloat16"),
         Case(shape=TINY, mb=4, recompute="full"), Case(shape=Shape(), mb=2, compile="blocks"),
         Case(shape=TINY, mb=1, compile="blocks"), Case(shape=TINY, mb=4, compile="blocks"),
         Case(shape=TINY, mb=8, compile="blocks"),
         Case(shape=TINY, mb=4, dtype="bfloat16", compile="blocks"),
         Case(shape=TINY, mb=4, dtype="bfloat16", compile="model")]
ATTENTION = [(4, 4, 2, 128, 32), (4, 8, 8, 128, 64), (1, 8, 8, 512, 64)]


def attention() -> None:
    import torch.nn.functional as F

    from partita.device_specs import matmul_rate
    from partita.planner import Assumptions

    torch.set_num_threads(1)
    preset = Assumptions.measured_cpu()
    peak = matmul_rate(256, 0.5)
    print(f"matmul rate {peak / 1e9:.1f} GFLOP/s (256^3, one thread), of which the "
          f"planner gives GEMMs {preset.gemm_peak_fraction}")
    for b, h, kvh, s, d in ATTENTION:
        q = torch.randn(b, h, s, d, requires_grad=True)
        k, v = (torch.randn(b, kvh, s, d, requires_grad=True) for _ in range(2))
        grad = torch.randn(b, h, s, d)
        fwd, bwd = [], []
        for i in range(33):
            start = time.perf_counter()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=kvh != h)
            mid = time.perf_counter()
            out.backward(grad)
            if i >= 3:  # warm-up
                fwd.append(mid - start)
                bwd.append(time.perf_counter() - mid)
        flops = 4.0 * b * h * s * s * d * 0.5  # causal: half the scores
        rate = peak * preset.gemm_peak_fraction * d / (d + preset.gemm_k_half)
        print(f"  (batch, heads, kv heads, seq, head_dim) = {(b, h, kvh, s, d)}: forward "
              f"{statistics.median(fwd) * 1e6:.0f} us, {flops / rate / statistics.median(fwd):.2f}"
              f" of the GEMM rate; backward {statistics.median(bwd) * 1e6:.0f} us, "
              f"{2.5 * flops / rate / statistics.median(bwd):.2f}")


def _measure(rank: int, world: int) -> list[dict]:
    torch.set_num_threads(1)
    return measure_cases(rank, world, CASES, timed_steps=10)


def steps(rounds: int) -> None:
    from partita.planner.cpu_profile import measure_local_cpu

    torch.set_num_threads(1)
    for r in range(rounds):
        gpu = measure_local_cpu()
        measured = run_distributed(_measure, 1, timeout=1800)[0]
        print(f"round {r}: profile {gpu.peak_flops / 1e9:.0f} GFLOP/s fp32, "
              f"{gpu.bf16_flops / 1e9:.1f} bf16, {gpu.memory_bandwidth / 1e9:.0f} GB/s, "
              f"{gpu.eager_op_s * 1e6:.1f} us per eager operation")
        for case, m in zip(CASES, measured):
            p = predict(case, gpu)["step_s"]
            print(f"  {case.label:<22} dim {case.shape.dim:>3}, {case.mb}x{case.shape.seq_len}: "
                  f"predicted {p * 1e3:6.1f} ms, measured {m['step_s'] * 1e3:6.1f} ms, "
                  f"predicted/measured {p / m['step_s']:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("attention", "steps"))
    parser.add_argument("--rounds", type=int, default=2, help="rounds of `steps` (default 2)")
    args = parser.parse_args()
    if args.part == "attention":
        attention()
    else:
        steps(args.rounds)


if __name__ == "__main__":
    main()
