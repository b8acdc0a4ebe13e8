"""pipeline step time: partita vs torch.distributed.pipelining, same model, same schedules

For pp=2 and pp=4 (gloo, partita's transfers through shared memory as by default, one
thread per rank) and each schedule pair — GPipe /
ScheduleGPipe, 1F1B / Schedule1F1B, interleaved 1F1B v=2 / ScheduleInterleaved1F1B —
both runtimes train the same model (same initial weights, same stage split, same
microbatches) forward and backward. Rounds alternate partita and torch after a warm-up,
which of the two goes first alternating too; a step's time is the slowest rank's; the
table shows medians and the median of the per-round ratios with its 99% interval; a
pair whose interval still spans 1.0 gets more rounds (`partita.bench.paired`). partita
runs through `build_parallel_model` (its data-parallel engine included, with nothing to
reduce); torch runs plain modules.

A last row times our 1F1B against a second copy of itself: how far a ratio strays from
1.0 on this machine when nothing differs (the table's noise floor; not part of R).

Last line: `pp: worst partita/torch step-time ratio R` (target R <= 1.0).
"""

from __future__ import annotations

import argparse
import statistics

from partita.arg_types import count, several
from partita.bench import paired
from partita.bench.dp import transport
from partita.bench.models import pipeline_config
from partita.local_world import run_distributed

SELF = "partita (same again)"

PAIRS = [("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"),
         ("interleaved-1f1b", 2, "ScheduleInterleaved1F1B"),
         # Not a peer: our 1F1B timed against itself, the noise floor of the table.
         ("1f1b", 1, SELF)]
OURS = [name for name, _, peer in PAIRS if peer != SELF]  # each against its torch peer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", "-p", **several(count), default=[2, 4])
    parser.add_argument("--microbatches", "-m", type=count, default=8)
    parser.add_argument("--schedules", **several(str, choices=OURS), default=OURS,
                        help="our schedules to time against their torch peers (default: "
                             "all three; the noise-floor row runs with 1f1b)")
    # 16: with 6 our 1F1B timed against itself read 0.987-1.030; R is the worst of six
    # pairs, so round-to-round noise alone pushes it up.
    parser.add_argument("--rounds", type=count, default=16,
                        help="timed rounds per pair, at least (even: each runtime goes "
                             "first equally often)")
    parser.add_argument("--max-rounds", type=count, default=128,
                        help="rounds a pair whose 99%% interval still spans 1.0 may double "
                             "up to (default 128)")
    parser.add_argument("--dim", type=count, default=256)
    parser.add_argument("--seq", type=count, default=128)
    parser.add_argument("--microbatch-size", type=count, default=2)
    parser.add_argument("--vocab", type=count, default=256)


def _config(p: int, schedule: str, v: int, args: argparse.Namespace):
    return pipeline_config(p, schedule, v, 2 * p, args, args.vocab)


def _torch_stages(cfg, layout, rank: int, device):
    """torch.distributed.pipelining stages over a plain copy of the same model."""
    import torch.nn as nn

    from partita.models.transformer import build_model
    from partita.pipeline import stage as st

    model = build_model(cfg.model_config(), device)
    plan = model.plan()
    st.keep_stages(model, plan, layout, rank)

    class Piece(nn.Module):
        def __init__(self, local: st.LocalStage) -> None:
            super().__init__()
            self.local = local
            names = [f"{plan.blocks}.{b}" for b in local.blocks]
            if local.first:
                names += [n for n in ("tok_embeddings", "pos_embeddings")
                          if getattr(model, n, None) is not None]
            if local.last:
                names += [n for n in plan.head if getattr(model, n, None) is not None]
            # Only this stage's modules are registered: torch scales their gradients.
            self.parts = nn.ModuleList(model.get_submodule(n) for n in names)

        def forward(self, x):
            if self.local.first:
                x = st.embed(model, x)
            x = st.run_blocks(model, plan, self.local, x)
            return st.head(model, x) if self.local.last else x

    return model, [Piece(s) for s in st.local_stages(layout, rank)]


def _worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    return [_pair(rank, world, args, name, v, peer) for name, v, peer in PAIRS
            if name in args.schedules]


def _pair(rank: int, world: int, args: argparse.Namespace, name: str, v: int,
          peer: str) -> dict:
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as tpp
    import torch.nn.functional as F

    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model

    device = torch.device("cpu")
    cfg = _config(world, name, v, args)
    mesh = Mesh(cfg.layout(world), rank, world)
    pm = build_parallel_model(cfg, mesh, device)
    layout = pm.runner.layout
    model, pieces = _torch_stages(cfg, layout, rank, device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(args.vocab, (cfg.train.global_batch, args.seq + 1), generator=gen)
    # Contiguous: torch 2.11's pipelining refuses a microbatch whose strides differ from
    # the ones it inferred (a slice of `tokens` keeps the stride of seq + 1).
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def ours() -> None:
        pm.runner.train(x, y, args.microbatches)

    resets = [pm.dp.zero_grad, lambda: model.zero_grad(set_to_none=True)]
    if peer == SELF:
        again = build_parallel_model(cfg, mesh, device)
        resets.append(again.dp.zero_grad)

        def theirs() -> None:
            again.runner.train(x, y, args.microbatches)
    else:
        stages = [tpp.PipelineStage(piece, piece.local.index, layout.n_stages, device,
                                    group=mesh.group("pipeline")) for piece in pieces]

        def loss_fn(logits, y):
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

        sched = getattr(tpp, peer)(stages if v > 1 else stages[0], args.microbatches,
                                   loss_fn=loss_fn)
        first = any(s.local.first for s in pieces)
        last = any(s.local.last for s in pieces)

        def theirs() -> None:
            kwargs = {"target": y, "losses": []} if last else {}
            sched.step(*((x,) if first else ()), **kwargs)

    runtimes = [ours, theirs]

    def time_side(k: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        runtimes[k]()
        took = paired.slowest_rank(time.perf_counter() - start)
        for reset in resets:
            reset()
        return took

    for k in (0, 1):  # warm-up (torch infers shapes here)
        time_side(k)
    times = paired.paired_rounds(time_side, args.rounds, args.max_rounds,
                                 None if peer == SELF else 1.0)
    return {"name": name, "v": v, "peer": peer, "partita": times[0], "torch": times[1],
            "estimate": paired.estimate_times(times)}


def run(args: argparse.Namespace) -> int:
    print(f"pipeline step time, partita vs torch.distributed.pipelining: m={args.microbatches}, "
          f"dim={args.dim}, seq={args.seq}, microbatch {args.microbatch_size}, "
          f"{transport()} against torch on gloo, "
          f"1 thread per rank, median of alternating rounds ({args.rounds}, doubled up to "
          f"{max(args.rounds, args.max_rounds)} where the 99% interval spans 1.0)")
    print(f"{'p':>2} {'partita schedule':<20} {'torch schedule':<25} {'partita ms':>10} "
          f"{'torch ms':>9} {'ratio':>6} {'interval':>13} {'rounds':>6}")
    worst = 0.0
    estimates = []
    for p in args.stages:  # a shape the model cannot take is said here, not by a worker
        for name, v, _ in PAIRS:
            _config(p, name, v, args)
    for p in args.stages:
        for r in run_distributed(_worker, p, (args,), timeout=3600)[0]:
            est = r["estimate"]
            estimates.append(est)
            if r["peer"] != SELF:
                worst = max(worst, est.median)
            label = r["name"] + (f" v={r['v']}" if r["v"] > 1 else "")
            print(f"{p:>2} {label:<20} {r['peer']:<25} "
                  f"{statistics.median(r['partita']) * 1e3:>10.1f} "
                  f"{statistics.median(r['torch']) * 1e3:>9.1f} {est.median:>6.3f} "
                  f"{est.span:>13} {est.rounds:>6}")
    paired.print_legend(estimates)
    print(f"pp: worst partita/torch step-time ratio {worst:.3f}")
    return 0
