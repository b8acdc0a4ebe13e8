"""ZeRO model-state bytes per rank, measured from live tensors, next to the paper's formulas.

Builds a model of P parameters on N gloo ranks for stages 0-3 (bf16 parameters, fp32
master weights, AdamW) from the meta device, runs one training step, and reads the
engine's memory ledger. The formulas (Rajbhandari et al., ZeRO, 2020, with K = 12 bytes
of fp32 master + Adam moments per parameter) are 16P, 4P + 12P/N, 2P + 14P/N and 16P/N;
only padding to N x 64-element slices may differ. Stage 3 also reports the peak of
gathered parameters during the step, which the at-rest figure leaves out, at the default
unit size (bucket_mb; the tiny model's blocks make one gather unit) and with one gather
unit per block (the least it can be).
"""

from __future__ import annotations

import argparse

import torch

from partita.arg_types import count
from partita.local_world import run_distributed
from partita.models.catalog import get_model_config
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model, transformer_init
from partita.zero.policies import ZeroConfig, ZeroStage

STAGES = (0, 1, 2, 3)


def formula(stage: int, p: int, n: int) -> float:
    """The paper's bytes per rank: 2 (bf16 parameters) + 2 (bf16 gradients) + K = 12
    (fp32 master and two moments) per parameter, each divided by N where the stage
    shards it: 16P, 4P + 12P/N, 2P + 14P/N, 16P/N."""
    s = ZeroStage(stage)
    params = 2 * p / n if s.shards_parameters else 2 * p
    grads = 2 * p / n if s.shards_gradients else 2 * p
    states = 12 * p / n if s.shards_optimizer_states else 12 * p
    return params + grads + states


def measure(rank: int, world: int, cfg: ModelConfig, stages: tuple[int, ...],
            seq: int, bucket_mb: float = ZeroConfig.bucket_mb) -> list[dict]:
    """One row per stage: the ledger after one step, plus stage 3's init requests."""
    import torch.nn.functional as F

    from partita.layout import Layout
    from partita.mesh import Mesh
    from partita.zero import DataParallel, MixedPrecision, model_init_fn

    mesh = Mesh(Layout(dp=world), rank, world)
    rows = []
    for stage in stages:
        model = build_model(cfg, device="meta", dtype=torch.bfloat16)
        p_count = sum(p.numel() for p in model.parameters())
        drawn = [0]
        base_init = model_init_fn(transformer_init(cfg))

        def init_fn(info, start, stop, base_init=base_init, drawn=drawn):
            drawn[0] += stop - start
            return base_init(info, start, stop)

        dp = DataParallel(model, mesh, zero=ZeroConfig(stage=stage, bucket_mb=bucket_mb),
                          precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                   master_dtype=torch.float32),
                          init_fn=init_fn, device=torch.device("cpu"))
        gen = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen)
        logits = dp.module(tokens[:, :-1])
        dp.backward(F.cross_entropy(logits.flatten(0, 1).float(), tokens[0, 1:]))
        dp.finish_grad_sync()
        dp.step()
        ledger = dp.memory_ledger()
        rows.append({"stage": stage, "P": p_count, "drawn": drawn[0], **ledger,
                     "biggest_group": max(b.padded for b in dp.buckets) * 2,
                     "at_rest_param_bytes": sum(p.untyped_storage().nbytes()
                                                for p in model.parameters())})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="catalog model (default tiny)")
    parser.add_argument("--world", type=count, default=4, help="ranks N (default 4)")
    parser.add_argument("--seq", type=count, default=64, help="sequence length of the step")


def run(args: argparse.Namespace) -> int:
    cfg = get_model_config(args.model)
    rows = run_distributed(measure, args.world, args=(cfg, STAGES, args.seq),
                           timeout=600)[0]
    # A unit size below any block's: one gather unit per block.
    per_block = run_distributed(measure, args.world, args=(cfg, (3,), args.seq, 1e-6),
                                timeout=600)[0][0]
    n = args.world
    p = rows[0]["P"]
    print(f"zero-memory: {args.model}, P = {p:,} parameters, N = {n} ranks, bf16 params + "
          "fp32 master + AdamW; bytes per rank (rank 0), counted from live tensors")
    head = (f"{'stage':>5} {'params':>11} {'grads':>11} {'master':>11} {'optimizer':>11} "
            f"{'measured':>11} {'formula':>16} {'paper':>11} {'dev':>7}")
    print(head)
    names = {0: "16P", 1: "4P+12P/N", 2: "2P+14P/N", 3: "16P/N"}
    worst = 0.0
    for r in rows:
        f = formula(r["stage"], p, n)
        measured = (r["parameters"] + r["gradients"] + r["master_weights"]
                    + r["optimizer_states"])
        dev = abs(measured - f) / f * 100
        worst = max(worst, dev)
        print(f"{r['stage']:>5} {r['parameters']:>11,} {r['gradients']:>11,} "
              f"{r['master_weights']:>11,} {r['optimizer_states']:>11,} {measured:>11,} "
              f"{names[r['stage']]:>16} {int(f):>11,} {dev:>6.2f}%")
    s3 = rows[-1]
    print(f"stage 3 during the step: gathered-parameter peak {s3['gathered_peak']:,} bytes "
          f"(largest group {s3['biggest_group']:,} bytes); with one gather unit per block "
          f"{per_block['gathered_peak']:,} bytes (largest group "
          f"{per_block['biggest_group']:,}); at start-up each rank drew "
          f"{s3['drawn']:,} of {p:,} parameter elements (its shard, never the model)")
    print(f"zero-memory: max deviation {worst:.2f}%")
    return 0
