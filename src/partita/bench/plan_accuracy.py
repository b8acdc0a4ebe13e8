"""The planner's predictions against partita's own measurements, layout by layout.

For every layout the test suite runs on CPU (dp 1/2/4/8 x ZeRO 0-3 in fp32 and bf16
with fp32 master weights, tp 2/4 with and without sequence parallelism, dp2 x tp2 with
ZeRO-1/3) one small model takes training steps on gloo ranks. Memory: model states
from the ZeRO engine's ledger, activations from the storages autograd saved for
backward. Communication: bytes each rank sent, counted by the mesh (tp + dp). Step
time: the median of timed steps on rank 0, against the planner's step time on the
`cpu` profile (a 1-thread matmul and copy rate measured at start; a world with more
ranks than cores gives each rank cores/ranks of one, so the profile is scaled by it).

Memory and communication should agree to a fraction of a percent. Step time is
indicative: the planner counts FLOPs and bytes; eager PyTorch, Python and gloo add
fixed costs per operation that dominate models this small, and this machine is shared.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from partita.bench.plan_measure import (
    COMM,
    Case,
    Shape,
    measure_cases,
    predict,
    rel_error,
    worst_rank,
)
from partita.planner import get_gpu
from partita.planner.hardware import GPUSpec
from partita.testing import run_distributed

DTYPES = ("float32", "bfloat16")


def layouts(shape: Shape) -> dict[int, list[Case]]:
    """World size -> the cases run in one world of that size."""
    out: dict[int, list[Case]] = {}
    for dp in (1, 2, 4, 8):
        out[dp] = [Case(dp=dp, zero=z, dtype=d, shape=shape) for z in range(4) for d in DTYPES]
    for tp in (2, 4):
        out[tp] += [Case(tp=tp, sp=sp, shape=shape) for sp in (False, True)]
    out[4] += [Case(dp=2, tp=2, zero=z, sp=True, shape=shape) for z in (1, 3)]
    return out


def device_share(gpu: GPUSpec, world: int) -> GPUSpec:
    """The profile of one rank when `world` ranks share this machine's cores."""
    share = min(1.0, (os.cpu_count() or 1) / world)
    return replace(gpu, peak_flops=gpu.peak_flops * share,
                   memory_bandwidth=gpu.memory_bandwidth * share)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="blocks (default 2)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps per layout after one warm-up (default 5)")
    parser.add_argument("--worlds", default="1,2,4,8",
                        help="world sizes to run, comma-separated (default 1,2,4,8)")


def run(args: argparse.Namespace) -> int:
    shape = Shape(dim=args.dim, n_layers=args.layers, seq_len=args.seq)
    gpu = get_gpu("cpu")
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"plan-accuracy: llama dim={shape.dim} layers={shape.n_layers} heads="
          f"{shape.n_heads} kv={shape.n_kv_heads} vocab={shape.vocab_size} seq={shape.seq_len}, "
          "2 sequences per rank, one microbatch; planner: Assumptions.measured_cpu(), "
          f"cpu profile {gpu.peak_flops / 1e9:.1f} GFLOP/s, "
          f"{gpu.memory_bandwidth / 1e9:.1f} GB/s per rank ({os.cpu_count()} cores)")
    print("bytes per rank (the fullest rank); step time: median of "
          f"{args.steps} steps on rank 0")
    head = (f"{'layout':<18} {'states pred':>11} {'measured':>10} {'err':>6} "
            f"{'activ pred':>10} {'measured':>10} {'err':>6} {'comm pred':>10} "
            f"{'counted':>10} {'err':>6} {'step pred':>9} {'measured':>9} {'err':>6}")
    print(head)
    print("-" * len(head))
    worst_mem = worst_comm = worst_time = 0.0
    for world in worlds:
        cases = layouts(shape)[world]
        per_rank = run_distributed(measure_cases, world, args=(cases, args.steps),
                                   timeout=900)
        rank_gpu = device_share(gpu, world)
        for i, case in enumerate(cases):
            m = worst_rank([r[i] for r in per_rank])
            m["step_s"] = per_rank[0][i]["step_s"]
            p = predict(case, rank_gpu)
            comm_p = sum(p[k] for k in COMM.values())
            comm_m = sum(m[k] for k in COMM.values())
            errs = {k: rel_error(p[k], m[k]) for k in ("model_states", "activations", "step_s")}
            comm_err = rel_error(comm_p, comm_m)
            worst_mem = max(worst_mem, errs["model_states"], errs["activations"])
            worst_comm = max(worst_comm, comm_err)
            worst_time = max(worst_time, errs["step_s"])
            print(f"{case.label:<18} {p['model_states']:>11,.0f} {m['model_states']:>10,} "
                  f"{_pct(errs['model_states'])} {p['activations']:>10,.0f} "
                  f"{m['activations']:>10,} {_pct(errs['activations'])} {comm_p:>10,.0f} "
                  f"{comm_m:>10,.0f} {_pct(comm_err)} {p['step_s'] * 1e3:>7.2f}ms "
                  f"{m['step_s'] * 1e3:>7.2f}ms {_pct(errs['step_s'])}")
    print(f"worst communication error {worst_comm * 100:.2f}%")
    print(f"plan-accuracy: worst memory error {worst_mem * 100:.2f}%, "
          f"worst step-time error {worst_time * 100:.0f}%")
    return 0


def _pct(err: float) -> str:
    return f"{err * 100:>5.1f}%"
