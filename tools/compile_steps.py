"""Whole training steps, eager against `train.compile=model`, in one process, alternating.

    PYTHONPATH=src python tools/compile_steps.py [--model tiny] [--batch 4] [--rounds 30]

One gloo rank, one thread, fp32. Four runners on copies of one model: torch's own loop
(the model, cross-entropy, clipping, fused AdamW) eager and with the model compiled, and
partita's stage 0 (`partita.bench.compile`'s runners) eager and compiled. Rounds of
three steps alternate between them, so a slow spell of a shared machine falls on all
four; printed: the median per-round ratio of each pair with the 10th-90th percentile of
the rounds. Where partita's compiled/eager ratio matches torch's own, what stands
between it and a target is the model's kernels, not partita's engine. A diagnostic
beside `partita bench compile` (processes per runner, whole pairs with intervals).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from partita.local_world import run_distributed

PAIRS = [("torch model", "torch eager"), ("partita model", "partita eager"),
         ("partita eager", "torch eager"), ("partita model", "torch model")]


def _worker(rank: int, world: int, name: str, batch: int, seq: int, rounds: int) -> None:
    from partita.bench import dp as harness
    from partita.bench.compile import EAGER, OURS0_MODEL, build_step
    from partita.compile import compile_model
    from partita.layout import Layout
    from partita.mesh import Mesh

    torch.set_num_threads(1)
    mesh = Mesh(Layout(dp=world), rank, world)
    template, vocab = harness.bench_model(name, "cpu")
    eager, compiled = copy.deepcopy(template), copy.deepcopy(template)
    compile_model(compiled)
    steps = {"torch eager": harness.torch_step(eager, harness.torch_adamw(eager.parameters())),
             "torch model": harness.torch_step(compiled,
                                               harness.torch_adamw(compiled.parameters())),
             "partita eager": build_step(EAGER, copy.deepcopy(template), mesh),
             "partita model": build_step(OURS0_MODEL, copy.deepcopy(template), mesh)}
    tokens = torch.randint(0, vocab, (batch, seq + 1),
                           generator=torch.Generator().manual_seed(0))
    for step in steps.values():  # the first compiles
        for _ in range(4):
            step(tokens)
    ms: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(3):
                step(tokens)
            ms[key].append((time.perf_counter() - t0) / 3 * 1e3)
    print(f"{name}, {batch}x{seq} tokens, {rounds} rounds; median ms per step: " + ", ".join(
        f"{k} {statistics.median(v):.1f}" for k, v in ms.items()))
    for a, b in PAIRS:
        ratios = [x / y for x, y in zip(ms[a], ms[b])]
        deciles = statistics.quantiles(ratios, n=10)
        print(f"  {a} / {b}: {statistics.median(ratios):.3f} "
              f"(rounds' 10th-90th percentile {deciles[0]:.3f}-{deciles[-1]:.3f})", flush=True)
    harness.release([steps.pop("partita eager"), steps.pop("partita model")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a bench model (default tiny)")
    parser.add_argument("--batch", type=int, default=4, help="sequences (default 4)")
    parser.add_argument("--seq", type=int, default=128, help="tokens each (default 128)")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    run_distributed(_worker, 1, timeout=3600,
                    args=(args.model, args.batch, args.seq, args.rounds))


if __name__ == "__main__":
    main()
