"""Context parallelism: ring and all-gather attention against one process, same threads.

There is no CPU peer to race (torch's `context_parallel` has no CPU sharding strategy
for its attention operator), so the peer is one process running the whole sequence with
c threads, against c ranks of one thread each: the same cores. Each side runs forward
and backward of the same model on the same tokens (no optimizer, no gradient reduction
on either side); the step time is the slowest rank's median over the timed steps.
Activation memory per rank is what autograd saves (`SavedTensorMeter`), against the
peer's divided by c.

Last line: `cp: worst partita/peer step-time ratio R; activation memory per rank 1/c
within E%`, R at c = 2 (the worse kind), E the worst over every c and kind.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from partita.context_parallel import KINDS, apply_context_parallel, sharding
from partita.layout import Layout
from partita.local_world import run_distributed
from partita.loss import cross_entropy
from partita.mesh import Mesh
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model
from partita.saved_tensors import SavedTensorMeter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--degrees", default="2,4", help="cp degrees, comma-separated")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up)")


def _model_cfg(args: dict) -> ModelConfig:
    return ModelConfig(vocab_size=256, dim=args["dim"], n_layers=args["layers"],
                       n_heads=args["heads"], n_kv_heads=args["kv_heads"],
                       max_seq_len=args["seq"])


def _tokens(args: dict) -> torch.Tensor:
    return torch.randint(256, (args["batch"], args["seq"] + 1),
                         generator=torch.Generator().manual_seed(0))


def _timed(model, x, y, steps: int, barrier) -> tuple[list[float], int]:
    meter = SavedTensorMeter(model)
    with meter:
        loss = cross_entropy(model(x), y)
    loss.backward()
    saved = meter.bytes
    times = []
    for _ in range(steps):
        barrier()
        start = time.perf_counter()
        cross_entropy(model(x), y).backward()
        barrier()
        times.append(time.perf_counter() - start)
    return times, saved


def _rank(rank: int, world: int, args: dict, kind: str) -> tuple[list[float], int]:
    mesh = Mesh(Layout(cp=world), rank, world)
    model = build_model(_model_cfg(args))
    apply_context_parallel(model, model.plan(), mesh.comm("context"), kind)
    tokens = _tokens(args)
    x, y = (sharding.shard(t, rank, world, dim=1) for t in (tokens[:, :-1], tokens[:, 1:]))
    return _timed(model, x, y, args["steps"], dist.barrier)


def _peer(args: dict, threads: int) -> tuple[list[float], int]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokens = _tokens(args)
        # The whole sequence: inputs row[:-1], targets row[1:], as the ranks' shards are.
        return _timed(build_model(_model_cfg(args)), tokens[:, :-1], tokens[:, 1:],
                      args["steps"], lambda: None)
    finally:
        torch.set_num_threads(before)


def run(args: argparse.Namespace) -> int:
    opts = dict(dim=args.dim, heads=args.heads, kv_heads=args.kv_heads, layers=args.layers,
                seq=args.seq, batch=args.batch, steps=args.steps)
    degrees = [int(c) for c in args.degrees.split(",")]
    for c in degrees:
        sharding.check_length(args.seq, c)
    print(f"model dim={args.dim} heads={args.heads} kv_heads={args.kv_heads} "
          f"layers={args.layers}, b={args.batch} s={args.seq}, fp32, forward+backward")
    print(f"{'c':>3} {'kind':<10}{'ms/step':>10}{'peer ms':>10}{'ratio':>8}"
          f"{'saved MiB/rank':>16}{'peer/c MiB':>12}{'mem err %':>10}")
    ratio_at_2, worst_err = None, 0.0
    for c in degrees:
        peer_times, peer_saved = _peer(opts, c)
        peer_ms = statistics.median(peer_times) * 1e3
        for kind in KINDS:
            ranks = run_distributed(_rank, c, args=(opts, kind), timeout=600)
            step_ms = statistics.median(max(r[0][i] for r in ranks)
                                        for i in range(args.steps)) * 1e3
            saved = max(r[1] for r in ranks)
            err = abs(saved / (peer_saved / c) - 1) * 100
            worst_err = max(worst_err, err)
            ratio = step_ms / peer_ms
            if c == 2:
                ratio_at_2 = max(ratio, ratio_at_2 or 0.0)
            print(f"{c:>3} {kind:<10}{step_ms:>10.1f}{peer_ms:>10.1f}{ratio:>8.3f}"
                  f"{saved / 2**20:>16.2f}{peer_saved / c / 2**20:>12.2f}{err:>10.2f}")
    shown = "n/a (c=2 not run)" if ratio_at_2 is None else f"{ratio_at_2:.3f}"
    print(f"cp: worst partita/peer step-time ratio {shown}; activation memory per rank 1/c "
          f"within {worst_err:.2f}%")
    return 0
