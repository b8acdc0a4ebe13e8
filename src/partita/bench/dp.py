"""Data parallelism: partita's stage 0 against torch DistributedDataParallel, one run.

Both train the same model from the same weights on the same batches, with the same world
size (gloo), one thread per rank and AdamW: the peers get torch's fastest, the fused
kernel (`fused=True`, not torch's default: on CPU the default is a loop over parameters,
foreach on GPUs, both slower), which partita's engine also calls, once per flat bucket.
After warm-up, rounds alternate ours and the peer, and which of the two goes first
alternates too (A B, B A, A B, ...), so neither always runs right after the other's
barrier; each round times a few steps between barriers. The verdict is the median of the per-round ratios. The timing harness
here also serves `partita bench zero`.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from partita.models.catalog import get_model_config
from partita.testing import run_distributed

LR = 1e-4
Step = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Setup:
    model: str = "tiny"
    batch: int = 4  # sequences per rank
    seq: int = 128
    warmup: int = 3
    rounds: int = 16
    steps: int = 2  # steps per timed round
    device: str = "cpu"  # "cuda": rank r on GPU r (`partita bench gpu`)


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    # In float32 whatever the logits' dtype, as torch's autocast computes it.
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def partita_step(model, mesh, stage: int, blocks=None, precision=None, **zero) -> Step:
    from partita.zero import AdamWConfig, DataParallel, ZeroConfig

    dp = DataParallel(model, mesh, zero=ZeroConfig(stage=stage, **zero),
                      optim=AdamWConfig(lr=LR), blocks=blocks, precision=precision)

    def step(tokens: torch.Tensor) -> None:
        dp.backward(_loss(dp.module(tokens[:, :-1]), tokens))
        dp.finish_grad_sync()
        dp.step()
        dp.zero_grad()
    step.engine = dp  # keeps it alive with the closure
    return step


# The peers' optimizer settings: torch's AdamW with its fused kernel (see the docstring);
# `bench zero` hands the same to ZeroRedundancyOptimizer and DeepSpeed.
TORCH_ADAMW = {"lr": LR, "fused": True}


def torch_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **TORCH_ADAMW)


def torch_step(model: torch.nn.Module, optimizer) -> Step:
    def step(tokens: torch.Tensor) -> None:
        _loss(model(tokens[:, :-1]), tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def ddp_step(model, mesh) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    return torch_step(ddp, torch_adamw(ddp.parameters()))


def build_step(name: str, model: torch.nn.Module, mesh) -> Step:
    if name == "partita stage 0":
        return partita_step(model, mesh, 0)
    if name == "torch DDP":
        return ddp_step(model, mesh)
    raise ValueError(name)


def time_pairs(rank: int, world: int, setup: Setup, pairs: list[tuple[str, str]],
               build: Callable[[str, torch.nn.Module, object], Step]) -> list[dict]:
    """Per pair (ours, peer): per-round seconds per step of each, interleaved."""
    import warnings

    import torch.distributed as dist

    from partita.mesh import Mesh, ParallelDims
    from partita.models.transformer import build_model

    # The peers call collectives torch 2.13 deprecated; one warning per call and rank
    # would bury the table.
    warnings.filterwarnings("ignore", category=FutureWarning)
    cfg = get_model_config(setup.model)
    mesh = Mesh(ParallelDims(dp=world), rank, world)
    device = torch.device("cuda", rank) if setup.device == "cuda" else torch.device("cpu")
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab_size, (setup.batch, setup.seq + 1),
                             generator=gen).to(device) for _ in range(4)]

    def wait() -> None:  # a GPU runs behind the host: the clock waits for its queue
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # Drawn once: the per-name init costs seconds per billion parameters; copies are cheap.
    template = build_model(cfg, device=device)
    out = []
    for ours, peer in pairs:
        steps = [build(name, copy.deepcopy(template), mesh) for name in (ours, peer)]
        for fn in steps:
            for i in range(setup.warmup):
                fn(batches[i % 4])
        times: list[list[float]] = [[], []]
        for r in range(setup.rounds):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for fn, acc in ((steps[k], times[k]) for k in order):
                wait()
                t0 = time.perf_counter()
                for i in range(setup.steps):
                    fn(batches[i % 4])
                wait()
                acc.append((time.perf_counter() - t0) / setup.steps)
        out.append({"ours": ours, "peer": peer, "t_ours": times[0], "t_peer": times[1],
                    "ratio": statistics.median(a / b for a, b in zip(*times))})
        del steps
        gc.collect()
    return out


def print_table(rows: list[dict], world: int, label: str = "") -> None:
    for r in rows:
        print(f"{world:>5} {r['ours']:>18} {statistics.median(r['t_ours']) * 1e3:>9.1f} "
              f"{r['peer']:>26} {statistics.median(r['t_peer']) * 1e3:>9.1f} "
              f"{r['ratio']:>7.3f}" + (f"  {label}" if label else ""))


TABLE_HEAD = (f"{'world':>5} {'partita':>18} {'ms/step':>9} {'peer':>26} {'ms/step':>9} "
              f"{'ratio':>7}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2, gloo)")
    parser.add_argument("--model", default=Setup.model)
    parser.add_argument("--batch", type=int, default=Setup.batch, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=Setup.seq)
    parser.add_argument("--rounds", type=int, default=Setup.rounds)


def setup_from(args: argparse.Namespace) -> Setup:
    return Setup(model=args.model, batch=args.batch, seq=args.seq, rounds=args.rounds)


def run(args: argparse.Namespace) -> int:
    setup = setup_from(args)
    rows = run_distributed(time_pairs, args.world, timeout=900,
                           args=(setup, [("partita stage 0", "torch DDP")], build_step))[0]
    print(f"dp: {setup.model}, {setup.batch}x{setup.seq} tokens per rank, gloo, 1 thread "
          f"per rank, {setup.rounds} interleaved rounds of {setup.steps} steps after "
          f"{setup.warmup} warm-up steps; median step times")
    print(TABLE_HEAD)
    print_table(rows, args.world)
    print(f"dp: partita/torch-ddp step-time ratio {rows[0]['ratio']:.3f}")
    return 0
