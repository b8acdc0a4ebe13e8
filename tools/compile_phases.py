"""Forward + backward time of partita's stage 0, eager against each compile mode.

    PYTHONPATH=src python tools/compile_phases.py tiny [--rounds 3] [--steps 20] [--world 2]
        [--batch 4] [--seq 128]

One process per mode and round (eager, `train.compile=blocks`, `train.compile=model`;
one thread, fp32, --batch x --seq tokens); each times `--steps` steps cut into forward +
loss, backward, and the rest (gradient sync, clipping, optimizer step, zero_grad), and
reports the median of the steps after the first three (compiling). Rounds alternate the
modes, so a slow spell of a shared machine falls on all of them; printed per round:
the compiled/eager ratios of forward + backward, which the planner's compile model
(`partita.planner.compiled`) is checked against. A diagnostic, not a benchmark: `partita
bench compile` times whole steps, pairs alternating within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from partita.bench import dp as harness
from partita.local_world import run_distributed

MODES = ("eager", "blocks", "model")
WARMUP = 3


def _worker(rank: int, world: int, name: str, mode: str, steps: int, batch: int,
            seq: int) -> dict[str, float]:
    from partita.bench.models import blocks_of
    from partita.compile import compile_block_modules, compile_model
    from partita.layout import Layout
    from partita.mesh import Mesh

    mesh = Mesh(Layout(dp=world), rank, world)
    model, vocab = harness.bench_model(name, "cpu")
    if mode == "blocks":
        compile_block_modules(blocks_of(model))
    step = harness.partita_step(model, mesh, 0)
    dp = step.engine
    if mode == "model":  # as parallelize does: after the engine
        compile_model(dp.module)
    tokens = torch.randint(0, vocab, (batch, seq + 1),
                           generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {"forward": [], "backward": [], "rest": []}
    for i in range(steps):
        t0 = time.perf_counter()
        loss = harness._loss(dp.module(tokens[:, :-1]), tokens)
        t1 = time.perf_counter()
        dp.backward(loss)
        t2 = time.perf_counter()
        dp.finish_grad_sync()
        dp.clip_grad_norm_(harness.CLIP)
        dp.step()
        dp.zero_grad()
        t3 = time.perf_counter()
        if i >= WARMUP:
            for key, a, b in (("forward", t0, t1), ("backward", t1, t2), ("rest", t2, t3)):
                times[key].append((b - a) * 1e3)
    dp.close()
    return {key: statistics.median(v) for key, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a bench model (tiny, llama-20m, ...)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="sequences (default 4)")
    parser.add_argument("--seq", type=int, default=128, help="tokens each (default 128)")
    parser.add_argument("--world", type=int, default=1,
                        help="ranks (gloo, one thread each; rank 0's times are printed)")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    ratios: dict[str, list[float]] = {"blocks": [], "model": []}
    for r in range(args.rounds):
        fb = {}
        for mode in MODES:
            ms = run_distributed(_worker, args.world, args=(args.model, mode, args.steps,
                                                         args.batch, args.seq),
                                 timeout=3600)[0]
            fb[mode] = ms["forward"] + ms["backward"]
            print(f"round {r}: {mode:<6} forward {ms['forward']:8.2f} ms, backward "
                  f"{ms['backward']:8.2f}, rest {ms['rest']:7.2f}", flush=True)
        for mode in ratios:
            ratios[mode].append(fb[mode] / fb["eager"])
        print(f"round {r}: forward + backward compiled/eager: " + ", ".join(
            f"{m} {ratios[m][-1]:.3f}" for m in ratios), flush=True)
    print(f"{args.model}: median compiled/eager forward + backward over {args.rounds} "
          "rounds: " + ", ".join(f"{m} {statistics.median(v):.3f} "
                                 f"({min(v):.3f}-{max(v):.3f})" for m, v in ratios.items()))


if __name__ == "__main__":
    main()
