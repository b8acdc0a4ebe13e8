"""Expert parallelism: partita's MoE layer against DeepSpeed's, same world, same shapes.

Each world (2 and 4 ranks, gloo, one thread per rank) runs both layers in one spawned
group: partita's `MoE` with `ExpertParallelDispatch` over an expert group of `--ep`
ranks, and `deepspeed.moe.layer.MoE` with `ep_size=--ep` (DS_BUILD_OPS=0, as installed;
it runs on CPU with gloo). Same hidden width, the same SwiGLU expert (partita's module,
deep-copied by DeepSpeed into each local expert), E experts, top-2, capacity factor 1
on both sides (DeepSpeed drops by its own rule, over the rank's batch; partita per
sequence); random token selection off. A step is forward and backward of
mean(out^2) + the auxiliary loss on the same tokens (no optimizer, no gradient
reduction on either side).

Step time: after a warm-up, rounds alternate partita and DeepSpeed, which of the two
goes first alternating too (`bench.paired`); a round times --steps steps, each between
barriers, and keeps the median of their slowest-rank times. R of a world is the median
of the per-round ratios with its 99% interval; rounds double (up to --max-rounds) while
the interval spans 1.0. Each side's CPU time per step (the rank's thread, median over
steps, the busiest rank) is printed too: the work done, which the load of other
processes on a shared machine does not inflate the way it does wall time.

Last line: `ep: worst partita/peer step-time ratio R (99% interval lo-hi, n rounds, at
world w)`, the world with the largest R; below 8 rounds the parenthesis says what its
interval is instead (`Estimate.stated`: "lo-hi: range of 2 rounds, 50% for the median").
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from partita.arg_types import count, several
from partita.bench import paired
from partita.bench.deepspeed_peer import import_deepspeed
from partita.experts import apply_expert_parallel
from partita.layout import Layout
from partita.local_world import run_distributed
from partita.mesh import Mesh
from partita.models import plan as roles
from partita.models.model_config import ModelConfig
from partita.models.moe import MoE, SwiGLU


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worlds", **several(count), default=[2, 4],
                        help="world sizes (default 2 4)")
    parser.add_argument("--ep", type=count, default=2, help="expert-parallel degree")
    parser.add_argument("--experts", type=count, default=4)
    parser.add_argument("--dim", type=count, default=256)
    parser.add_argument("--ffn", type=count, default=512, help="each expert's hidden width")
    parser.add_argument("--batch", type=count, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=count, default=128)
    parser.add_argument("--rounds", type=count, default=8,
                        help="alternating rounds (partita, DeepSpeed) before doubling")
    parser.add_argument("--max-rounds", type=count, default=32,
                        help="cap on rounds while the ratio's interval spans 1.0")
    parser.add_argument("--steps", type=count, default=5,
                        help="timed steps per round (the round keeps their median)")


def _config(a: dict) -> ModelConfig:
    return ModelConfig(vocab_size=256, dim=a["dim"], n_layers=1, n_heads=1,
                       max_seq_len=a["seq"], n_experts=a["experts"], top_k=2,
                       expert_ffn_dim=a["ffn"], capacity_factor=1.0)


def _partita_layer(a: dict, mesh: Mesh) -> nn.Module:
    torch.manual_seed(0)
    holder = nn.Module()
    holder.moe = MoE(_config(a))
    for p in holder.parameters():
        nn.init.normal_(p, std=0.02)
    apply_expert_parallel(holder, roles.ModelPlan(roles={"moe": roles.MOE}),
                          mesh.comm("expert"))
    return holder.moe


def _deepspeed_layer(a: dict) -> nn.Module:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    torch.manual_seed(0)
    expert = SwiGLU(a["dim"], a["ffn"])
    return DeepSpeedMoE(hidden_size=a["dim"], expert=expert, num_experts=a["experts"],
                        ep_size=a["ep"], k=2, capacity_factor=1.0, eval_capacity_factor=1.0,
                        use_rts=False)


def _step_partita(layer: nn.Module, x: torch.Tensor) -> None:
    layer(x).square().mean().backward()  # the aux losses join inside (MoE docstring)


def _step_deepspeed(layer: nn.Module, x: torch.Tensor) -> None:
    out, aux, _ = layer(x)
    (out.square().mean() + 0.01 * aux).backward()


def _side(step, layer: nn.Module, x: torch.Tensor, steps: int,
          cpu: list[float]) -> float:
    """One round of one side: the median over `steps` steps of the slowest rank's wall
    seconds (the same on every rank); this rank's thread CPU seconds go to `cpu`."""
    walls = []
    for _ in range(steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        step(layer, x)
        layer.zero_grad(set_to_none=True)
        cpu.append(time.thread_time() - start_cpu)
        dist.barrier()
        walls.append(time.perf_counter() - start)
    slowest = torch.tensor(walls, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def _rank(rank: int, world: int, a: dict) -> dict:
    os.environ.setdefault("DS_BUILD_OPS", "0")
    deepspeed = import_deepspeed()

    deepspeed.init_distributed(dist_backend="gloo")
    mesh = Mesh(Layout(dp=world, ep=a["ep"]), rank, world)
    sides = ((_step_partita, _partita_layer(a, mesh)), (_step_deepspeed, _deepspeed_layer(a)))
    x = torch.randn(a["batch"], a["seq"], a["dim"],
                    generator=torch.Generator().manual_seed(rank))
    cpu: tuple[list[float], list[float]] = ([], [])
    for step, layer in sides:  # warm-up
        _side(step, layer, x, 2, [])

    def time_side(k: int) -> float:
        return _side(*sides[k], x, a["steps"], cpu[k])

    times = paired.paired_rounds(time_side, a["rounds"], a["max_rounds"], 1.0)
    return {"times": times, "cpu": [statistics.median(c) for c in cpu]}


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("deepspeed") is None:
        print("partita bench ep races DeepSpeed's MoE layer, and deepspeed is not "
              "installed here: pip install deepspeed (DS_BUILD_OPS=0 builds no CUDA ops).",
              file=sys.stderr)
        return 2
    a = dict(ep=args.ep, experts=args.experts, dim=args.dim, ffn=args.ffn, batch=args.batch,
             seq=args.seq, rounds=args.rounds, max_rounds=max(args.rounds, args.max_rounds),
             steps=args.steps)
    print(f"MoE layer: dim={args.dim} experts={args.experts} ffn={args.ffn} top-2 "
          f"ep={args.ep}, {args.batch}x{args.seq} tokens per rank, fp32, forward+backward; "
          f"alternating rounds of {args.steps} steps ({a['rounds']}, doubling to "
          f"{a['max_rounds']} while the 99% interval spans 1.0)")
    print(f"load average at start {paired.load_average()} on {os.cpu_count()} cores "
          "(shared machine: R is a wall-time ratio; its interval says how far the load "
          "lets it be read)")
    print(f"{'world':>6}{'partita ms':>12}{'deepspeed ms':>14}{'R':>8}{'interval':>14}"
          f"{'rounds':>8}{'partita cpu ms':>16}{'deepspeed cpu ms':>18}")
    worst = None
    estimates = []
    for world in args.worlds:
        ranks = run_distributed(_rank, world, args=(a,), timeout=1800)
        times = ranks[0]["times"]  # the same on every rank (slowest-rank round times)
        est = paired.estimate_times(times)
        estimates.append(est)
        cpu = [max(r["cpu"][k] for r in ranks) * 1e3 for k in (0, 1)]
        print(f"{world:>6}{statistics.median(times[0]) * 1e3:>12.2f}"
              f"{statistics.median(times[1]) * 1e3:>14.2f}{est.median:>8.3f}{est.span:>14}"
              f"{est.rounds:>8}{cpu[0]:>16.2f}{cpu[1]:>18.2f}")
        if worst is None or est.median > worst[1].median:
            worst = (world, est)
    paired.print_legend(estimates)
    print(f"load average at end {paired.load_average()}")
    world, est = worst
    print(f"ep: worst partita/peer step-time ratio {est.median:.3f} ({est.stated}, at "
          f"world {world})")
    return 0
