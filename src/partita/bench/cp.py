"""Context parallelism: ring and all-gather attention against one process, same threads.

There is no CPU peer to race (torch's `context_parallel` has no CPU sharding strategy
for its attention operator), so the peer is one process running the whole sequence with
c threads, against c ranks of one thread each: the same cores. Each side runs forward
and backward of the same model on the same tokens (no optimizer, no gradient reduction
on either side).

Step time: in one world of c ranks, partita's step (every rank, one thread each) and the
peer's (rank 0 with c threads while the others wait at a barrier) alternate, round by
round (`bench.paired`); a round's time is the slowest rank's. R is the median of the
per-round ratios with its 99% interval; rounds double (up to --max-rounds) until the
interval lies on one side of 1.0.

Balance: each rank's `AttentionClock` adds up the time its attention pieces compute,
forward and backward, without the waits on transfers. CPU time of the rank's thread
(immune to other processes taking the core) and wall time are both kept; the figure is
the slowest rank's CPU time over the mean, per timed step (median over the rounds).

Activation memory per rank is what autograd saves (`SavedTensorMeter`), against the
peer's divided by c.

Last lines: `cp: attention balance ...` and `cp: worst partita/peer step-time ratio R;
activation memory per rank 1/c within E%`, R at c = 2 (the worse kind), E the worst over
every c and kind.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from partita.arg_types import count, several
from partita.bench import paired
from partita.context_parallel import (
    KINDS,
    ContextParallelAttention,
    apply_context_parallel,
    sharding,
)
from partita.context_parallel.clock import AttentionClock
from partita.layout import Layout
from partita.local_world import run_distributed
from partita.loss import cross_entropy
from partita.mesh import Mesh
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model
from partita.saved_tensors import SavedTensorMeter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--degrees", **several(count), default=[2, 4],
                        help="cp degrees (default 2 4)")
    parser.add_argument("--seq", type=count, default=4096,
                        help="tokens per sequence (long enough that attention dominates)")
    parser.add_argument("--batch", type=count, default=1)
    parser.add_argument("--dim", type=count, default=64)
    parser.add_argument("--heads", type=count, default=4)
    parser.add_argument("--kv-heads", type=count, default=2)
    parser.add_argument("--layers", type=count, default=2)
    parser.add_argument("--rounds", type=count, default=6,
                        help="alternating rounds (ours, peer) per kind, before doubling")
    parser.add_argument("--max-rounds", type=count, default=24,
                        help="cap on rounds while the ratio's interval spans 1.0")
    # Kept for older command lines: one round is one timed step of each side.
    parser.add_argument("--steps", type=count, default=None, help=argparse.SUPPRESS)


def _model_cfg(args: dict) -> ModelConfig:
    return ModelConfig(vocab_size=256, dim=args["dim"], n_layers=args["layers"],
                       n_heads=args["heads"], n_kv_heads=args["kv_heads"],
                       max_seq_len=args["seq"])


def _tokens(args: dict) -> torch.Tensor:
    return torch.randint(256, (args["batch"], args["seq"] + 1),
                         generator=torch.Generator().manual_seed(0))


def _step(model, x, y) -> None:
    cross_entropy(model(x), y).backward()


def _saved_bytes(model, x, y) -> int:
    meter = SavedTensorMeter(model)
    with meter:
        loss = cross_entropy(model(x), y)
    loss.backward()  # also the warm-up step
    return meter.bytes


class _Peer:
    """The whole sequence in one process (rank 0) with c threads."""

    def __init__(self, args: dict, threads: int) -> None:
        tokens = _tokens(args)
        # The whole sequence: inputs row[:-1], targets row[1:], as the ranks' shards are.
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]
        self.model = build_model(_model_cfg(args))
        self.threads = threads
        self.saved = self._run(lambda: _saved_bytes(self.model, self.x, self.y))

    def _run(self, fn):
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)

    def step(self) -> None:
        self._run(lambda: _step(self.model, self.x, self.y))


def _rank(rank: int, world: int, args: dict, kinds: list[str], rounds: int,
          max_rounds: int) -> dict:
    mesh = Mesh(Layout(cp=world), rank, world)
    tokens = _tokens(args)
    x, y = (sharding.shard(t, rank, world, dim=1) for t in (tokens[:, :-1], tokens[:, 1:]))
    peer = _Peer(args, world) if rank == 0 else None
    out = {"peer_saved": peer.saved if peer else 0, "kinds": {}}
    for kind in kinds:
        out["kinds"][kind] = _race(mesh, kind, args, x, y, peer, rounds, max_rounds)
    return out


def _race(mesh: Mesh, kind: str, args: dict, x: torch.Tensor, y: torch.Tensor,
          peer: _Peer | None, rounds: int, max_rounds: int) -> dict:
    """One kind against the peer in alternating rounds, on every rank of the world."""
    model = build_model(_model_cfg(args))
    apply_context_parallel(model, model.plan(), mesh.comm("context"), kind)
    clock = AttentionClock()
    for core in model.modules():
        if isinstance(core, ContextParallelAttention):
            core.clock = clock
    saved = _saved_bytes(model, x, y)
    attention: list[tuple[float, float]] = []  # (cpu, wall) seconds per timed step

    def time_side(k: int) -> float:
        dist.barrier()  # every rank starts the round together
        start = time.perf_counter()
        if k == 0:
            clock.reset()
            _step(model, x, y)
            attention.append((clock.cpu_seconds, clock.seconds))
        elif peer is not None:
            peer.step()
        dist.barrier()
        return paired.slowest_rank(time.perf_counter() - start)

    times = paired.paired_rounds(time_side, rounds, max_rounds, 1.0)
    return {"times": times, "saved": saved, "attention": attention}


def _balance(per_rank: list[list[tuple[float, float]]]) -> tuple[float, float, list[float]]:
    """(slowest over mean of CPU time, the same of wall time, each rank's median CPU
    seconds): per timed step across ranks, then the median over steps."""
    steps = len(per_rank[0])
    cpu, wall = [], []
    for i in range(steps):
        c = [r[i][0] for r in per_rank]
        w = [r[i][1] for r in per_rank]
        cpu.append(max(c) / statistics.mean(c))
        wall.append(max(w) / statistics.mean(w))
    medians = [statistics.median(s[0] for s in r) for r in per_rank]
    return statistics.median(cpu), statistics.median(wall), medians


def run(args: argparse.Namespace) -> int:
    opts = dict(dim=args.dim, heads=args.heads, kv_heads=args.kv_heads, layers=args.layers,
                seq=args.seq, batch=args.batch)
    degrees = args.degrees
    for c in degrees:
        sharding.check_length(args.seq, c)
    rounds = args.steps if args.steps is not None else args.rounds
    max_rounds = max(rounds, args.max_rounds if args.steps is None else rounds)
    print(f"model dim={args.dim} heads={args.heads} kv_heads={args.kv_heads} "
          f"layers={args.layers}, b={args.batch} s={args.seq}, fp32, forward+backward; "
          f"ours: c ranks x 1 thread, peer: 1 process x c threads; alternating rounds "
          f"({rounds}, doubling to {max_rounds} while the 99% interval spans 1.0)")
    print(f"load average at start {paired.load_average()} on {os.cpu_count()} cores "
          "(shared machine: R is a wall-time ratio; its interval says how far the load "
          "lets it be read)")
    print(f"{'c':>3} {'kind':<10}{'ms/step':>9}{'peer ms':>9}{'R':>7}{'interval':>14}"
          f"{'rounds':>7}{'attn max/mean':>14}{'saved MiB/rank':>16}{'peer/c MiB':>11}"
          f"{'mem err %':>10}")
    ratio_at_2, worst_err, worst_balance = None, 0.0, 0.0
    est_at_2 = None
    balance_rows = []
    estimates = []
    for c in degrees:
        ranks = run_distributed(_rank, c, args=(opts, list(KINDS), rounds, max_rounds),
                                timeout=1800)
        peer_saved = ranks[0]["peer_saved"]
        for kind in KINDS:
            res = [r["kinds"][kind] for r in ranks]
            times = res[0]["times"]  # the same on every rank (slowest-rank round times)
            est = paired.estimate_times(times)
            estimates.append(est)
            saved = max(r["saved"] for r in res)
            err = abs(saved / (peer_saved / c) - 1) * 100
            worst_err = max(worst_err, err)
            cpu_bal, wall_bal, per_rank_cpu = _balance([r["attention"] for r in res])
            worst_balance = max(worst_balance, cpu_bal)
            balance_rows.append((c, kind, cpu_bal, wall_bal, per_rank_cpu))
            if c == 2 and (ratio_at_2 is None or est.median > ratio_at_2):
                ratio_at_2, est_at_2 = est.median, est
            print(f"{c:>3} {kind:<10}{statistics.median(times[0]) * 1e3:>9.1f}"
                  f"{statistics.median(times[1]) * 1e3:>9.1f}{est.median:>7.3f}"
                  f"{est.span:>14}{est.rounds:>7}{cpu_bal:>14.3f}"
                  f"{saved / 2**20:>16.2f}{peer_saved / c / 2**20:>11.2f}{err:>10.2f}")
    paired.print_legend(estimates)
    print("attention compute per rank (CPU seconds of its thread per step, median; the "
          "slowest over the mean, CPU and wall):")
    for c, kind, cpu_bal, wall_bal, per_rank in balance_rows:
        ms = " ".join(f"{s * 1e3:.1f}" for s in per_rank)
        print(f"  c={c} {kind:<10} ranks [{ms}] ms; max/mean CPU {cpu_bal:.3f}, "
              f"wall {wall_bal:.3f}")
    print(f"cp: attention balance: the slowest rank's attention time is within "
          f"{(worst_balance - 1) * 100:.1f}% of the mean (worst over c and kinds)")
    print(f"load average at end {paired.load_average()}")
    shown = "n/a (c=2 not run)" if est_at_2 is None else (
        f"{ratio_at_2:.3f} ({est_at_2.stated})")
    print(f"cp: worst partita/peer step-time ratio {shown}; activation memory per rank 1/c "
          f"within {worst_err:.2f}%")
    return 0
