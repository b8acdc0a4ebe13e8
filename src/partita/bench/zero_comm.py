"""Bytes each rank sends per training step for ZeRO stages 0-3, in units of Psi.

Counted where the collectives are issued (partita.comm), as a ring sends them, then
expressed as parameter elements over Psi (the parameter count) with the ring factor
(N-1)/N taken out, as the ZeRO paper does: stages 0-2 move 2 Psi per step (all-reduce,
or reduce-scatter + all-gather), stage 3 moves 3 Psi (all-gather for forward, again for
backward, reduce-scatter of gradients); partita's stage 3 less the root group and the
last gather unit, which stay gathered from forward into backward.
"""

from __future__ import annotations

import argparse

import torch

from partita.arg_types import count
from partita.local_world import run_distributed
from partita.models.catalog import get_model_config
from partita.models.model_config import ModelConfig
from partita.zero.policies import ZeroStage

STAGES = (0, 1, 2, 3)


def measure(rank: int, world: int, cfg: ModelConfig, seq: int, steps: int) -> list[dict]:
    import torch.nn.functional as F

    from partita.layout import Layout
    from partita.mesh import Mesh
    from partita.models.transformer import build_model, transformer_init
    from partita.zero import DataParallel, MixedPrecision, ZeroConfig, model_init_fn

    mesh = Mesh(Layout(dp=world), rank, world)
    rows = []
    for stage in STAGES:
        model = build_model(cfg, device="meta")
        psi = sum(p.numel() for p in model.parameters())
        dp = DataParallel(model, mesh, zero=ZeroConfig(stage=stage, bucket_mb=1.0),
                          precision=MixedPrecision(param_dtype=torch.float32),
                          init_fn=model_init_fn(transformer_init(cfg)), device=torch.device("cpu"))
        gen = torch.Generator().manual_seed(rank)
        per_step = {}
        for step in range(steps + 1):
            mesh.counter.reset()
            tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen)
            logits = dp.module(tokens[:, :-1])
            dp.backward(F.cross_entropy(logits.flatten(0, 1), tokens[0, 1:]))
            dp.finish_grad_sync()
            dp.clip_grad_norm_(1.0)
            dp.step()
            dp.zero_grad()
            if step:  # step 0 is warm-up
                for (purpose, op), nbytes in mesh.counter.sent.items():
                    if purpose == "zero_shard":
                        per_step[op] = per_step.get(op, 0.0) + nbytes / steps
        ring = world / (world - 1)
        rows.append({"stage": stage, "psi": psi,
                     "ops": {op: b / 4 * ring / psi for op, b in per_step.items()}})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="catalog model (default tiny)")
    parser.add_argument("--world", type=count, default=2, help="ranks N (default 2)")
    parser.add_argument("--seq", type=count, default=32)
    parser.add_argument("--steps", type=count, default=2)


def run(args: argparse.Namespace) -> int:
    if args.world < 2:
        from partita.errors import PartitaError

        raise PartitaError("zero-comm needs --world 2 or more: one rank sends nothing.")
    cfg = get_model_config(args.model)
    rows = run_distributed(measure, args.world, args=(cfg, args.seq, args.steps),
                           timeout=600)[0]
    psi = rows[0]["psi"]
    print(f"zero-comm: {args.model}, Psi = {psi:,} parameters, N = {args.world} ranks; "
          "volume per rank per step in Psi (ring factor (N-1)/N removed)")
    print(f"{'stage':>5} {'all_reduce':>11} {'reduce_scatter':>15} {'all_gather':>11} "
          f"{'total':>8} {'paper':>6}")
    totals = {}
    for r in rows:
        ops = r["ops"]
        totals[r["stage"]] = sum(ops.values())
        print(f"{r['stage']:>5} {ops.get('all_reduce', 0):>11.3f} "
              f"{ops.get('reduce_scatter', 0):>15.3f} {ops.get('all_gather', 0):>11.3f} "
              f"{totals[r['stage']]:>8.3f} {3 if ZeroStage(r['stage']).shards_parameters else 2:>6}")
    print("(stages 1-3 also all-reduce the 8-byte gradient-norm scalar, shown as 0.000)")
    print(f"zero-comm: stage3/stage0 volume ratio {totals[3] / totals[0]:.3f}")
    return 0
