"""Compiled training: partita eager vs compiled, and compiled partita vs compiled peers.

Pairs, at each world size of --worlds (default 1 and 2 ranks, gloo, one thread each):

    partita stage 0, compiled blocks  vs  partita stage 0, eager        -> C (blocks)
    partita stage 0, compiled model   vs  partita stage 0, eager        -> C (model)
    partita stage 0, compiled blocks  vs  torch DDP, compiled blocks
    partita stage 3, compiled blocks  vs  FSDP2 (fully_shard per block), compiled blocks

Every compiled runner against a peer compiles the same thing, each transformer block's
forward (`partita.compile`: what `train.compile=blocks` does; the peers as torchtitan
does, blocks compiled before DDP or fully_shard wraps them), with inductor's C++ backend
on CPU; the second pair compiles the whole model's forward instead (`train.compile=model`,
which stage 0 allows). The first step of each runner, which compiles, is timed on its own
and reported as compile time; the steady-state step times come from alternating rounds
after warm-up (`partita.bench.paired`, through the dp benchmark's harness). Last line:
`compile: compiled/eager step-time ratio C; worst partita/peer compiled ratio R`, C the
faster mode's worst (largest) eager pair over the world sizes (both modes on the line
before it), R the worst peer pair.

`--precision bf16` trains every runner in bf16 with fp32 master weights, as `bench gpu`
does: partita's `MixedPrecision(bf16, reduce fp32)`, DDP under `autocast(bf16)` and
FSDP2 with `MixedPrecisionPolicy(bf16, fp32)`; the same model code, so the same
attention kernel (`model.attention = "auto"`: explicit scores for the tiny model's
short bf16 sequences on a CPU).

`--model tiny-moe` runs all this on a mixture of experts (every expert on each rank):
the routing statistics and the dispatch stay eager between a block's compiled pieces
(`partita.eager_only`), and DDP needs no `find_unused_parameters`, since an expert
that gets no token still enters the grouped matmul with zero rows.
"""

from __future__ import annotations

import argparse
import copy
import functools
import time

import torch

from partita.arg_types import count, several
from partita.bench import dp as harness
from partita.bench import paired
from partita.bench.models import CHOICES, blocks_of, model_name
from partita.local_world import run_distributed

EAGER = "partita s0 eager"
OURS0 = "partita s0 compiled"
OURS0_MODEL = "partita s0 compiled model"
OURS3 = "partita s3 compiled"
DDP = "torch DDP compiled"
FSDP = "FSDP2 compiled"
PAIRS = [(OURS0, EAGER), (OURS0_MODEL, EAGER), (OURS0, DDP), (OURS3, FSDP)]


def _compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    from partita.compile import compile_block_modules

    compile_block_modules(blocks_of(model))
    return model


def build_step(name: str, model: torch.nn.Module, mesh, precision: str = "fp32"
               ) -> harness.Step:
    """The runner `name`, training in fp32 or (`precision` "bf16") in bf16 with fp32
    master weights."""
    from partita.bench import gpu

    bf16 = precision == "bf16"
    ours = functools.partial(gpu.partita_bf16 if bf16 else harness.partita_step, model, mesh)
    if name == EAGER:
        return ours(0)
    if name == OURS0_MODEL:  # as parallelize does for compile=model: after the engine
        from partita.compile import compile_model

        step = ours(0)
        compile_model(step.engine.module)
        return step
    model = _compile_blocks(model)
    if name == OURS0:
        return ours(0)
    if name == OURS3:
        return ours(3)
    if name == DDP:
        return gpu.ddp_autocast(model, mesh) if bf16 else harness.ddp_step(model, mesh)
    if name == FSDP:
        from partita.bench.zero import _fsdp2_step

        return gpu.fsdp2_bf16(model, mesh, True) if bf16 else _fsdp2_step(model, mesh, True)
    raise ValueError(name)


def _first_steps(rank: int, world: int, setup: harness.Setup, precision: str
                 ) -> dict[str, float]:
    """Seconds of each runner's first step (compiling) and of its second (compiled):
    their difference is the compile time."""
    from partita.layout import Layout
    from partita.mesh import Mesh

    mesh = Mesh(Layout(dp=world), rank, world)
    template, vocab = harness.bench_model(setup.model, "cpu")
    tokens = torch.randint(0, vocab, (setup.batch, setup.seq + 1),
                           generator=torch.Generator().manual_seed(rank))
    out = {}
    for name in (OURS0, OURS0_MODEL, OURS3, DDP, FSDP):
        step = build_step(name, copy.deepcopy(template), mesh, precision)
        took = []
        for _ in range(2):
            t0 = time.perf_counter()
            step(tokens)
            took.append(paired.slowest_rank(time.perf_counter() - t0))
        out[name] = took[0] - took[1]
        harness.release([step])
        del step
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worlds", **several(count), default=[1, 2],
                        help="world sizes (default 1 2)")
    parser.add_argument("--model", type=model_name, default="tiny",
                        help=f"{', '.join(CHOICES)} (tiny-moe: a mixture of experts) or any "
                        "catalog model (default tiny)")
    parser.add_argument("--batch", type=count, default=harness.Setup.batch)
    parser.add_argument("--seq", type=count, default=harness.Setup.seq)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="fp32, or bf16 compute with fp32 master weights (default fp32)")
    parser.add_argument("--rounds", type=count, default=12, help="timed rounds per pair")
    parser.add_argument("--max-rounds", type=count, default=24,
                        help="rounds a close pair may double up to (default 24)")


def run(args: argparse.Namespace) -> int:
    setup = harness.Setup(model=args.model, batch=args.batch, seq=args.seq,
                          rounds=args.rounds, max_rounds=max(args.rounds, args.max_rounds),
                          warmup=2)  # compiling happens before, in _first_steps
    print(harness.describe("compile", setup, "0.8 (eager) and 1.0 (peers)")
          + f", {args.precision}")
    print("compile time: the first step's time minus the second's (slowest rank)")
    c_worst = {OURS0: 0.0, OURS0_MODEL: 0.0}  # per compile mode, worst over the worlds
    r_worst = 0.0
    for world in args.worlds:
        compile_s = run_distributed(_first_steps, world, timeout=3600,
                                    args=(setup, args.precision))[0]
        print(f"world {world}: compile time " + ", ".join(
            f"{name} {s:.1f} s" for name, s in compile_s.items()), flush=True)
        thresholds = {(OURS0, EAGER): 0.8, (OURS0_MODEL, EAGER): 0.8, (OURS0, DDP): 1.0,
                      (OURS3, FSDP): 1.0}
        print(harness.TABLE_HEAD, flush=True)  # the ranks print the rows as they finish
        rows = run_distributed(harness.time_pairs, world, timeout=3600,
                               args=(setup, PAIRS,
                                     functools.partial(build_step, precision=args.precision),
                                     thresholds,
                                     harness.RowPrinter(world)))[0]
        paired.print_legend(r["estimate"] for r in rows)
        for r in rows:
            ratio = r["estimate"].median
            if r["peer"] == EAGER:
                c_worst[r["ours"]] = max(c_worst[r["ours"]], ratio)
            else:
                r_worst = max(r_worst, ratio)
    print(f"compiled/eager by mode (worst over the worlds): blocks {c_worst[OURS0]:.3f}, "
          f"model {c_worst[OURS0_MODEL]:.3f}")
    print(f"compile: compiled/eager step-time ratio {min(c_worst.values()):.3f}; "
          f"worst partita/peer compiled ratio {r_worst:.3f}")
    return 0
