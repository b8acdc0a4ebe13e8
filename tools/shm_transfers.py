"""Step time with point-to-point transfers (the pipeline's, ring attention's) through
shared-memory rings against gloo's TCP, in alternating rounds of one world.

    PYTHONPATH=src python tools/shm_transfers.py --parallel.pp=2 --train.microbatches=16
    PYTHONPATH=src python tools/shm_transfers.py --parallel.pp=2 --train.microbatches=16 \\
        --parallel.schedule=interleaved-1f1b --parallel.virtual_stages=2
    PYTHONPATH=src python tools/shm_transfers.py --parallel.cp=2 --against gloo

Any `partita train` settings choose the model and layout (the default model otherwise;
one data-parallel replica: every rank takes the whole batch). Each process builds the
model twice from the same seed: once as by default (every collective and transfer of a
gloo group on one host through shared memory) and once with only the transfers on gloo
(`--against transfers`, the default: collectives still through the arena, from
PARTITA_SHM_MIN_BYTES=1, which also keeps all-to-alls on gloo) or with everything on gloo
(`--against gloo`, `Mesh(shm_collectives=False)`), then times `--steps` training steps
of each per round on the same batch, sides alternating which goes first. Printed: the
median step of the slower rank per side, and rings / gloo as the median of per-round
ratios with its 99% interval (`partita.bench.paired`).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from partita.bench.paired import estimate_times, load_average, paired_rounds, slowest_rank
from partita.config import load_config
from partita.local_world import run_distributed
from partita.testing import token_batch


def _timed(rank: int, world: int, overrides: list[str], rounds: int, steps: int,
           against: str):
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model, dims_from_config
    from partita.shm_collectives import ENV_MIN_BYTES

    torch.set_num_threads(1)
    cfg = load_config(None, overrides)
    os.environ.pop(ENV_MIN_BYTES, None)
    models = []
    for side in ("rings", against):
        if side == "transfers":
            os.environ[ENV_MIN_BYTES] = "1"  # read when the mesh is made
        torch.manual_seed(0)
        mesh = Mesh(dims_from_config(cfg, world), rank, world,
                    shm_collectives=side != "gloo")
        models.append(build_parallel_model(cfg, mesh, torch.device("cpu")))
    tokens = token_batch(0, cfg.train.global_batch, cfg.data.seq_len,
                         cfg.model_config().vocab_size)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def run(pm, n: int) -> None:
        for _ in range(n):
            pm.runner.train(x, y, cfg.train.microbatches)
            pm.dp.finish_grad_sync()
            pm.dp.zero_grad()

    for pm in models:  # warm-up
        run(pm, 2)

    def time_side(k: int) -> float:
        start = time.perf_counter()
        run(models[k], steps)
        return slowest_rank((time.perf_counter() - start) / steps)

    return paired_rounds(time_side, rounds, rounds, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="steps per side and round")
    ap.add_argument("--against", choices=("transfers", "gloo"), default="transfers",
                    help="the other side: transfers on gloo (collectives still through "
                         "shared memory), or everything on gloo")
    args, overrides = ap.parse_known_args()
    times = run_distributed(_timed, args.world,
                            (overrides, args.rounds, args.steps, args.against),
                            timeout=3600)[0]
    est = estimate_times(times)
    rings, gloo = (sorted(t)[len(t) // 2] * 1e3 for t in times)
    other = "transfers on gloo" if args.against == "transfers" else "all on gloo"
    print(f"{' '.join(overrides) or 'default'} on {args.world} ranks: rings {rings:.1f} ms, "
          f"{other} {gloo:.1f} ms per step; ratio {est.median:.3f} "
          f"({est.low:.3f}-{est.high:.3f}, {est.rounds} rounds); load {load_average()}")


if __name__ == "__main__":
    main()
