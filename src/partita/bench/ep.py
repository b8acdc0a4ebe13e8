"""Expert parallelism: partita's MoE layer against DeepSpeed's, same world, same shapes.

Each world (2 and 4 ranks, gloo, one thread per rank) runs both layers in one spawned
group: partita's `MoE` with `ExpertParallelDispatch` over an expert group of `--ep`
ranks, and `deepspeed.moe.layer.MoE` with `ep_size=--ep` (DS_BUILD_OPS=0, as installed;
it runs on CPU with gloo). Same hidden width, the same SwiGLU expert (partita's module,
deep-copied by DeepSpeed into each local expert), E experts, top-2, capacity factor 1
on both sides (DeepSpeed drops by its own rule, over the rank's batch; partita per
sequence); random token selection off. A step is forward and backward of
mean(out^2) + the auxiliary loss on the same tokens (no optimizer, no gradient
reduction on either side). Rounds alternate partita / DeepSpeed after a warm-up; a
round's time is the median over its steps of the slowest rank; the ratio of a world is
the median of its per-round ratios.

Last line: `ep: worst partita/peer step-time ratio R` (the worst world).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from partita.experts import apply_expert_parallel
from partita.layout import Layout
from partita.local_world import run_distributed
from partita.mesh import Mesh
from partita.models import plan as roles
from partita.models.model_config import ModelConfig
from partita.models.moe import MoE, SwiGLU


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="each expert's hidden width")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    # 3 rounds of 3 steps read anywhere from 0.34 to 1.24 per round on a loaded 2-core
    # machine; 9 of 5 (about 30 s for both worlds) give a steadier median.
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")


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


def _timed(step, layer: nn.Module, x: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step(layer, x)
        layer.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _rank(rank: int, world: int, a: dict) -> list[tuple[list[float], list[float]]]:
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    mesh = Mesh(Layout(dp=world, ep=a["ep"]), rank, world)
    ours, peer = _partita_layer(a, mesh), _deepspeed_layer(a)
    x = torch.randn(a["batch"], a["seq"], a["dim"],
                    generator=torch.Generator().manual_seed(rank))
    _timed(_step_partita, ours, x, 1)  # warm-up
    _timed(_step_deepspeed, peer, x, 1)
    rounds = []
    for _ in range(a["rounds"]):
        rounds.append((_timed(_step_partita, ours, x, a["steps"]),
                       _timed(_step_deepspeed, peer, x, a["steps"])))
    return rounds


def run(args: argparse.Namespace) -> int:
    a = dict(ep=args.ep, experts=args.experts, dim=args.dim, ffn=args.ffn,
             batch=args.batch, seq=args.seq, rounds=args.rounds, steps=args.steps)
    print(f"MoE layer: dim={args.dim} experts={args.experts} ffn={args.ffn} top-2 "
          f"ep={args.ep}, {args.batch}x{args.seq} tokens per rank, fp32, forward+backward")
    print(f"{'world':>6}{'round':>7}{'partita ms':>12}{'deepspeed ms':>14}{'ratio':>8}")
    worst = 0.0
    for world in (int(w) for w in args.worlds.split(",")):
        ranks = run_distributed(_rank, world, args=(a,), timeout=600)
        ratios = []
        for r in range(args.rounds):
            ours = statistics.median(max(rk[r][0][i] for rk in ranks)
                                     for i in range(args.steps)) * 1e3
            peer = statistics.median(max(rk[r][1][i] for rk in ranks)
                                     for i in range(args.steps)) * 1e3
            ratios.append(ours / peer)
            print(f"{world:>6}{r:>7}{ours:>12.2f}{peer:>14.2f}{ours / peer:>8.3f}")
        ratio = statistics.median(ratios)
        print(f"{world:>6} median ratio {ratio:.3f}")
        worst = max(worst, ratio)
    print(f"ep: worst partita/peer step-time ratio {worst:.3f}")
    return 0
