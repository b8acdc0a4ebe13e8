"""The planner's predictions against partita's own measurements, layout by layout.

For every layout the test suite runs on CPU (dp 1/2/4/8 x ZeRO 0-3 in fp32 and bf16
with fp32 master weights, tp 2/4 with and without sequence parallelism, dp2 x tp2 with
ZeRO-1/3, pipelines: 1F1B, GPipe, zero-bubble H1 and interleaved at pp 2/4, with dp,
ZeRO-1/2 and tp+sp, and dp2 x tp2 x pp2; selective and full recompute under these
kinds of layout, host and disk offload, context parallelism: ring and all-gather at cp 2/4,
with dp + ZeRO-1, tp + sp, dp2 x tp2 x cp2, and cp2 with full and selective recompute;
expert parallelism at ep 2/4 with ZeRO-1/2/3, tp and pp, ZeRO-3 at ep 1, and ep2 with
each recompute mode, on a 4-expert top-2 variant; compiled blocks alone, under zero
bubble and with selective recompute) one small model takes training steps on gloo
ranks; memory is compared per pipeline stage. Memory: model states (and, under
offload, the host's) from the ZeRO engine's ledger, activations from the storages
autograd saved for backward. Communication: bytes each rank sent, counted by the mesh
(tp, dp, pp, cp, and ep: the all-to-alls). Step
time: the median of timed steps on rank 0, against the planner's step time on the
`cpu` profile, calibrated here: 1-thread fp32 and bf16 matmul rates, a copy rate and
the cost of one eager operation measured at start, the gloo all-reduce latency and
bandwidth measured in each world before its cases (the profile's loopback figures are
nominal), and a world with more ranks than cores gives each rank cores/ranks of one
core, so rates are scaled by that share and the operation cost by its inverse.

Memory and communication should agree to a fraction of a percent. Step time is
indicative: the planner counts FLOPs, bytes and partita's eager operations
(`planner.eager_ops`), which dominate models this small; gloo's own threads and the
other tenants of a shared machine it cannot know, and they move a median by tens of
percent from one minute to the next.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace

from partita.arg_types import count, several
from partita.bench import paired
from partita.bench.plan_measure import (
    COMM_NAMES,
    Case,
    Shape,
    measure_cases,
    measure_link,
    predict,
    rel_error,
    worst_by_stage,
    worst_rank,
)
from partita.errors import PartitaError
from partita.local_world import run_distributed
from partita.planner import Assumptions, get_gpu
from partita.planner.hardware import GPUSpec

DTYPES = ("float32", "bfloat16")


def layouts(shape: Shape) -> dict[int, list[Case]]:
    """World size -> the cases run in one world of that size."""
    out: dict[int, list[Case]] = {}
    for dp in (1, 2, 4, 8):
        out[dp] = [Case(dp=dp, zero=z, dtype=d, shape=shape) for z in range(4) for d in DTYPES]
    for tp in (2, 4):
        out[tp] += [Case(tp=tp, sp=sp, shape=shape) for sp in (False, True)]
    out[4] += [Case(dp=2, tp=2, zero=z, sp=True, shape=shape) for z in (1, 3)]
    # Pipelines (4 microbatches unless said); interleaving and pp=4 need 4 blocks.
    deep = replace(shape, n_layers=max(shape.n_layers, 4))
    out[2] += [Case(pp=2, microbatches=4, schedule=s, dtype=d, shape=shape)
               for s in ("1f1b", "gpipe", "zb-h1") for d in DTYPES]
    out[2] += [Case(pp=2, microbatches=4, schedule="interleaved-1f1b", vpp=2, shape=deep)]
    out[4] += [Case(pp=4, microbatches=4, shape=deep),
               Case(pp=4, microbatches=8, schedule="zb-h1", shape=deep),
               Case(tp=2, sp=True, pp=2, microbatches=4, schedule="zb-h1",
                    dtype="bfloat16", shape=shape),
               Case(dp=2, pp=2, zero=1, microbatches=4, shape=shape),
               Case(dp=2, pp=2, zero=2, microbatches=4, shape=shape),
               Case(tp=2, sp=True, pp=2, microbatches=4, dtype="bfloat16", shape=shape)]
    out[8] += [Case(dp=2, tp=2, pp=2, zero=2, sp=True, microbatches=2, shape=shape)]
    # Activation recomputation, each mode (and the first block only) under each kind of
    # layout: what a layer keeps, and the rerun's working set in backward.
    for rc in ("selective", "full"):
        out[1] += [Case(recompute=rc, dtype=d, shape=shape) for d in DTYPES]
        out[1] += [Case(recompute=rc, recompute_layers=1, shape=shape)]
        out[2] += [Case(tp=2, sp=True, recompute=rc, shape=shape),
                   Case(dp=2, zero=3, recompute=rc, shape=shape)]
        out[2] += [Case(pp=2, microbatches=4, schedule=s, recompute=rc, shape=shape)
                   for s in ("1f1b", "gpipe", "zb-h1")]
        out[4] += [Case(dp=2, tp=2, zero=3, sp=True, recompute=rc, shape=shape),
                   Case(pp=4, microbatches=8, schedule="zb-h1", recompute=rc, shape=deep)]
    # Context parallelism: activations 1/c, the ring's and the all-gather's bytes, the
    # ZeRO group dp x cp.
    out[2] += [Case(cp=2, shape=shape), Case(cp=2, cp_kind="allgather", dtype="bfloat16",
                                             shape=shape)]
    out[4] += [Case(cp=4, shape=shape), Case(cp=4, cp_kind="allgather", shape=shape),
               Case(dp=2, cp=2, zero=1, shape=shape), Case(tp=2, sp=True, cp=2, shape=shape)]
    out[8] += [Case(dp=2, tp=2, cp=2, zero=1, sp=True, shape=shape)]
    # With recomputation: full reruns the exchanges; selective leaves the cp core alone.
    out[2] += [Case(cp=2, recompute="full", shape=shape),
               Case(cp=2, cp_kind="allgather", recompute="selective", shape=shape)]
    # Expert parallelism (routing forced balanced): expert parameters per rank over their
    # own ZeRO group, dispatch and combine buffers, the all-to-alls' bytes; every block
    # MoE, and every second one (MoE and dense blocks mixed).
    moe = replace(shape, n_experts=4, top_k=2, moe_every=1)
    half = replace(moe, moe_every=2)
    out[2] += [Case(dp=2, ep=2, shape=half), Case(dp=2, ep=2, zero=1, dtype="bfloat16",
                                                    shape=moe)]
    out[4] += [Case(dp=4, ep=2, zero=2, shape=half), Case(dp=4, ep=4, zero=1, shape=moe),
               # ZeRO-3: experts gathered over dp/ep apart from their block (ep 1: in it).
               Case(dp=4, ep=2, zero=3, shape=half), Case(dp=4, ep=2, zero=3, shape=moe),
               Case(dp=4, ep=4, zero=3, dtype="bfloat16", shape=half),
               Case(dp=4, zero=3, shape=half),
               Case(dp=2, tp=2, ep=2, zero=1, dtype="bfloat16", shape=half),
               Case(dp=2, tp=2, ep=2, zero=3, sp=True, shape=moe),
               Case(cp=2, tp=2, ep=2, zero=3, sp=True, shape=moe),
               # Experts split over tp x ep (one of four per rank).
               Case(dp=2, tp=2, ep=2, zero=3, sp=True, moe_tp="experts", shape=moe),
               Case(dp=2, tp=2, ep=2, zero=1, moe_tp="experts", shape=half),
               # Each expert's width split over tp.
               Case(dp=2, tp=2, ep=2, zero=3, sp=True, moe_tp="hidden", shape=moe),
               Case(dp=2, tp=2, ep=2, zero=1, moe_tp="hidden", shape=half),
               Case(cp=4, ep=4, cp_kind="allgather", shape=half),
               Case(dp=2, pp=2, ep=2, microbatches=2, shape=moe),
               Case(dp=4, ep=2, zero=3, recompute="full", shape=half)]
    out[2] += [Case(dp=2, ep=2, recompute=rc, shape=half) for rc in ("selective", "full")]
    # Host offload: the host bytes (master, moments, gradient staging, shards) too.
    out[1] += [Case(offload="optimizer", dtype=d, shape=shape) for d in DTYPES]
    out[2] += [Case(dp=2, zero=z, offload="optimizer", dtype="bfloat16", shape=shape)
               for z in (1, 2)]
    out[2] += [Case(dp=2, zero=3, offload="optimizer+params", shape=shape)]
    # Disk offload at a budget that does not bind: the engine's buffer sets hold its
    # largest bucket's sub-group (on a CPU no gradient staged); the files' bytes.
    out[1] += [Case(offload="optimizer+disk", dtype="bfloat16", host_budget_gb=1.0,
                    shape=shape)]
    out[2] += [Case(dp=2, zero=3, offload="optimizer+params+disk", host_budget_gb=1.0,
                    shape=shape)]
    # Compiled blocks: what a compiled block saves, what a zero-bubble stage holds between
    # I and W (their weight gradients), and selective recompute inside them.
    out[1] += [Case(compile="blocks", dtype=d, shape=shape) for d in DTYPES]
    # The whole model compiled: its final norm fused, and recomputed blocks rerun inside
    # the compiled backward.
    out[1] += [Case(compile="model", dtype=d, shape=shape) for d in DTYPES]
    out[1] += [Case(compile="model", recompute=rc, shape=shape) for rc in ("selective", "full")]
    # In bf16 the model's attention computes explicit scores (`model.attention = "auto"`),
    # which compiled recompute regions keep differently (`planner.activation_memory`).
    out[1] += [Case(compile=c, recompute="selective", dtype="bfloat16", shape=shape)
               for c in ("blocks", "model")]
    out[2] += [Case(dp=2, zero=1, compile="model", recompute="full", dtype="bfloat16",
                    shape=shape), Case(tp=2, sp=True, compile="model", shape=shape)]
    out[2] += [Case(pp=2, microbatches=4, schedule="zb-h1", compile="blocks", shape=shape),
               Case(pp=2, microbatches=4, recompute="selective", compile="blocks",
                    shape=shape),
               Case(tp=2, sp=True, recompute="selective", compile="blocks", shape=shape)]
    return out


def device_share(gpu: GPUSpec, world: int, link: tuple[float, float],
                 efficiency: float) -> GPUSpec:
    """The profile of one rank when `world` ranks share this machine's cores, with the
    gloo link measured in that world (latency per step, effective bandwidth; stored as
    a nominal figure that the planner's link efficiency brings back to the measurement)."""
    share = min(1.0, (os.cpu_count() or 1) / world)
    latency, bandwidth = link
    if world == 1:
        latency, bandwidth = gpu.intra_node_latency, gpu.intra_node_bandwidth
    return replace(gpu, peak_flops=gpu.peak_flops * share,
                   bf16_flops=gpu.bf16_flops * share, eager_op_s=gpu.eager_op_s / share,
                   memory_bandwidth=gpu.memory_bandwidth * share,
                   bf16_memory_bandwidth=gpu.bf16_memory_bandwidth * share,
                   intra_node_latency=latency, intra_node_bandwidth=bandwidth / efficiency)


def _world(rank: int, world: int, cases: list[Case], steps: int) -> dict:
    link = measure_link(rank, world)
    return {"link": link, "cases": measure_cases(rank, world, cases, steps)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=count, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=count, default=2, help="blocks (default 2)")
    parser.add_argument("--seq", type=count, default=32, help="sequence length (default 32)")
    parser.add_argument("--steps", type=count, default=5,
                        help="timed steps per layout after one warm-up (default 5)")
    parser.add_argument("--worlds", **several(count), default=[1, 2, 4, 8],
                        help="world sizes to run (default 1 2 4 8)")


def run(args: argparse.Namespace) -> int:
    shape = Shape(dim=args.dim, n_layers=args.layers, seq_len=args.seq)
    cases_by_world = layouts(shape)
    unknown = sorted(set(args.worlds) - set(cases_by_world))
    if unknown:
        raise PartitaError(
            f"--worlds: no layouts of {', '.join(map(str, unknown))} ranks; plan-accuracy "
            f"runs worlds of {', '.join(map(str, sorted(cases_by_world)))} ranks.")
    gpu = get_gpu("cpu")  # measures this CPU: after the arguments are known to be good
    print(f"plan-accuracy: llama dim={shape.dim} layers={shape.n_layers} heads="
          f"{shape.n_heads} kv={shape.n_kv_heads} vocab={shape.vocab_size} seq={shape.seq_len}, "
          "2 sequences per rank, one microbatch; planner: Assumptions.measured_cpu(), "
          f"cpu profile {gpu.peak_flops / 1e9:.1f} GFLOP/s, "
          f"{gpu.memory_bandwidth / 1e9:.1f} GB/s per rank ({os.cpu_count()} cores)")
    print("bytes per rank (the fullest rank); step time: median of "
          f"{args.steps} steps on rank 0; load average at start {paired.load_average()} "
          "(shared machine)")
    head = (f"{'layout':<30} {'states':>10} {'measured':>10} {'err':>6} "
            f"{'activ pred':>10} {'measured':>10} {'err':>6} {'comm pred':>10} "
            f"{'counted':>10} {'err':>6} {'step pred':>9} {'measured':>9} {'err':>6}")
    print(head)
    print("-" * len(head))
    worst_mem = worst_comm = worst_time = 0.0
    one_rank_time: list[float] = []  # what the compute model alone decides
    for world in args.worlds:
        cases = cases_by_world[world]
        runs = run_distributed(_world, world, args=(cases, args.steps), timeout=900)
        per_rank = [r["cases"] for r in runs]
        link = runs[0]["link"]
        rank_gpu = device_share(gpu, world, link, Assumptions.measured_cpu().intra_node_efficiency)
        if world > 1:
            print(f"world {world}: gloo all-reduce measured {link[0] * 1e6:.0f} us per "
                  f"latency step, {link[1] / 1e9:.2f} GB/s")
        for i, case in enumerate(cases):
            results = [r[i] for r in per_rank]
            whole, p = worst_rank(results), predict(case, rank_gpu)
            comm_p = sum(p[k] for k in COMM_NAMES)
            comm_m = sum(whole[k] for k in COMM_NAMES)
            comm_err = rel_error(comm_p, comm_m)
            time_err = rel_error(p["step_s"], results[0]["step_s"])
            worst_comm = max(worst_comm, comm_err)
            worst_time = max(worst_time, time_err)
            if world == 1:
                one_rank_time.append(time_err)
            # Memory per pipeline stage; communication and time once per layout.
            for stage, m in worst_by_stage(results).items():
                ps = predict(case, stage=stage)
                errs = [rel_error(ps[k], m[k]) for k in ("model_states", "activations",
                                                         "host_model_states")]
                worst_mem = max(worst_mem, *errs)
                label = case.label + (f" s{stage}" if case.pp > 1 else "")
                row = (f"{label:<30} {ps['model_states']:>10,.0f} {m['model_states']:>10,} "
                       f"{_pct(errs[0])} {ps['activations']:>10,.0f} "
                       f"{m['activations']:>10,} {_pct(errs[1])}")
                if stage == 0:
                    row += (f" {comm_p:>10,.0f} {comm_m:>10,.0f} {_pct(comm_err)} "
                            f"{p['step_s'] * 1e3:>7.2f}ms {results[0]['step_s'] * 1e3:>7.2f}ms "
                            f"{_pct(time_err)}")
                print(row)
    print(f"load average at end {paired.load_average()}")
    print(f"worst communication error {worst_comm * 100:.2f}%")
    if one_rank_time:
        print(f"step-time error at one rank (no gloo): median "
              f"{statistics.median(one_rank_time) * 100:.0f}%, worst "
              f"{max(one_rank_time) * 100:.0f}%")
    print(f"plan-accuracy: worst memory error {worst_mem * 100:.2f}%, "
          f"worst step-time error {worst_time * 100:.0f}%")
    return 0



def _pct(err: float) -> str:
    return f"{err * 100:>5.1f}%"
