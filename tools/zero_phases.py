"""Phase times of partita's stage 0 or 1 against torch DDP or ZeroRedundancyOptimizer,
or of partita's stage 3 against its own stage 2.

    PYTHONPATH=src python tools/zero_phases.py llama-20m 0 [--world 2] [--rounds 8]
    PYTHONPATH=src python tools/zero_phases.py hf-llama-20m 3

Each step is cut into forward, backward (with the gradient reduction), clipping to 1.0,
optimizer step and zero_grad by a barrier after every phase, so each phase's time is
the slowest rank's; ours and the peer alternate step by step. A diagnostic, not a
benchmark: the barriers remove the overlap a real step has (`partita bench dp` and
`bench zero` time whole steps).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from partita.bench.models import bench_model, block_names
from partita.local_world import run_distributed

PHASES = ("forward", "backward", "clip", "step", "zero_grad")


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _worker(rank: int, world: int, name: str, stage: int, rounds: int) -> dict:
    warnings.filterwarnings("ignore")
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from partita.layout import Layout
    from partita.mesh import Mesh
    from partita.zero import AdamWConfig, DataParallel, ZeroConfig

    torch.set_num_threads(1)
    mesh = Mesh(Layout(dp=world), rank, world)
    model, vocab = bench_model(name)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (4, 129), generator=gen) for _ in range(4)]

    def partita(zero_stage: int):
        dp = DataParallel(copy.deepcopy(model), mesh, zero=ZeroConfig(stage=zero_stage),
                          optim=AdamWConfig(lr=1e-4), blocks=block_names(model))

        def run(t, mark):
            loss = _loss(dp.module(t[:, :-1]), t)
            mark()
            dp.backward(loss)
            dp.finish_grad_sync()
            mark()
            dp.clip_grad_norm_(1.0)
            mark()
            dp.step()
            mark()
            dp.zero_grad()
            mark()
        return run

    ours = partita(stage)
    if stage == 3:  # against partita's stage 2: what gathering at use costs
        peer = partita(2)
        return _alternate(ours, peer, batches, rounds)
    ddp = DistributedDataParallel(copy.deepcopy(model))
    adamw = {"lr": 1e-4, "fused": True}
    opt = (torch.optim.AdamW(ddp.parameters(), **adamw) if stage == 0 else
           ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                   **adamw))

    def peer(t, mark):
        loss = _loss(ddp(t[:, :-1]), t)
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        mark()
        opt.step()
        mark()
        opt.zero_grad(set_to_none=True)
        mark()

    return _alternate(ours, peer, batches, rounds)


def _alternate(ours, peer, batches: list[torch.Tensor], rounds: int) -> dict:
    """Phase times of `ours` and `peer`, which take turns step by step."""
    out: dict[str, list[list[float]]] = {"partita": [], "peer": []}
    for r in range(rounds + 2):  # two warm-up rounds
        order = [("partita", ours), ("peer", peer)]
        for side, fn in order if r % 2 == 0 else order[::-1]:
            clock = _Clock()
            fn(batches[r % 4], clock.mark)
            if r >= 2:
                out[side].append(clock.times)
    return out


class _Clock:
    """Seconds between consecutive barriers, from the one at construction."""

    def __init__(self) -> None:
        self.times: list[float] = []
        dist.barrier()
        self.last = time.perf_counter()

    def mark(self) -> None:
        dist.barrier()
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("stage", type=int, choices=(0, 1, 3),
                        help="0: against DDP; 1: ZeroRedundancyOptimizer; 3: partita stage 2")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    out = run_distributed(_worker, args.world, args=(args.model, args.stage, args.rounds),
                          timeout=3600)[0]
    peer = {0: "torch DDP", 1: "ZeroRedundancyOptimizer", 3: "partita stage 2"}[args.stage]
    print(f"{args.model}, stage {args.stage} vs {peer}, {args.world} ranks, {args.rounds} "
          "rounds: median ms per phase (min-max), partita | peer")
    for k, phase in enumerate(PHASES):
        cells = []
        for side in ("partita", "peer"):
            xs = [row[k] * 1e3 for row in out[side]]
            cells.append(f"{statistics.median(xs):8.1f} ({min(xs):.1f}-{max(xs):.1f})")
        print(f"{phase:>10} {cells[0]:>26} | {cells[1]}")


if __name__ == "__main__":
    main()
