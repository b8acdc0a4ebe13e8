"""Data parallelism: partita's stage 0 against torch DistributedDataParallel, one run.

Both train the same model from the same weights on the same batches, with the same world
size (gloo), one thread per rank, gradient clipping (`CLIP`) and AdamW: the peers get
torch's fastest, the fused kernel (`fused=True`, not torch's default: on CPU the default
is a loop over parameters, foreach on GPUs, both slower), which partita's engine also
calls, once per flat bucket.
After warm-up, rounds alternate ours and the peer, and which of the two goes first
alternates too (A B, B A, A B, ...), so neither always runs right after the other's
barrier; each round times a few steps between barriers (the slowest rank's time). The
verdict is the median of the per-round ratios with its 99% interval; against a peer,
rounds double from --rounds until the interval lies on one side of 1.0 or
--max-rounds is reached (`partita.bench.paired`). The timing harness here also serves
`partita bench zero` and `partita bench compile`.

Each pair's row is printed by rank 0 as soon as the pair is done (a crash later in a
long run keeps the rows before it), and each pair's runners are released before the
next pair builds its own (`release`), so a run holds one pair's memory at a time.
`bench dp` times one pair and prints its table once it is done (`print_table`), with
`paired.legend` above the column heads where the interval is not a 99% one.
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

from partita import shm_collectives, shm_share
from partita.arg_types import count
from partita.bench import paired
from partita.bench.models import CHOICES, bench_model, block_names, model_name
from partita.local_world import run_distributed

LR = 1e-4
# Every runner clips the global gradient norm to this, as `partita train` does by
# default (train.grad_clip): clipping reads every gradient once more and writes it once,
# which a benchmark without it does not see (it was partita's largest gap to DDP on a
# 20M-parameter model, invisible on the tiny one).
CLIP = 1.0
Step = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Setup:
    model: str = "tiny"
    batch: int = 4  # sequences per rank
    seq: int = 128
    warmup: int = 3
    rounds: int = 16  # at least; doubled up to max_rounds where a verdict is close
    max_rounds: int = 16
    steps: int = 2  # steps per timed round
    device: str = "cpu"  # "cuda": rank r on GPU r (`partita bench gpu`)

    def rank_device(self, rank: int) -> torch.device:
        """Where rank `rank` computes: GPU `rank` under "cuda", else the CPU."""
        return torch.device("cuda", rank) if self.device == "cuda" else torch.device("cpu")


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    # In float32 whatever the logits' dtype, as torch's autocast computes it.
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def partita_step(model, mesh, stage: int, blocks=None, precision=None, **zero) -> Step:
    from partita.zero import AdamWConfig, DataParallel, ZeroConfig

    dp = DataParallel(model, mesh, zero=ZeroConfig(stage=stage, **zero),
                      optim=AdamWConfig(lr=LR), blocks=blocks or block_names(model),
                      precision=precision)

    def step(tokens: torch.Tensor) -> None:
        dp.backward(_loss(dp.module(tokens[:, :-1]), tokens))
        dp.finish_grad_sync()
        dp.clip_grad_norm_(CLIP)
        dp.step()
        dp.zero_grad()
    step.engine = dp  # keeps it alive with the closure
    step.release = dp.close  # its hooks would keep the engine alive (DataParallel.close)
    return step


def release(steps: list[Step]) -> None:
    """Free what the runners in `steps` hold (the caller drops its references after):
    a runner may carry a `release` callable for what dropping it does not free."""
    while steps:
        getattr(steps.pop(), "release", lambda: None)()  # no name left holding it
    gc.collect()


# The peers' optimizer settings: torch's AdamW with its fused kernel (see the docstring);
# `bench zero` hands the same to ZeroRedundancyOptimizer and DeepSpeed.
TORCH_ADAMW = {"lr": LR, "fused": True}


def torch_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **TORCH_ADAMW)


def torch_step(model: torch.nn.Module, optimizer) -> Step:
    def step(tokens: torch.Tensor) -> None:
        _loss(model(tokens[:, :-1]), tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
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
               build: Callable[[str, torch.nn.Module, object], Step],
               thresholds: dict[tuple[str, str], float] | None = None,
               report: Callable[[dict], None] | None = None) -> list[dict]:
    """Per pair (ours, peer): per-round seconds per step of each, interleaved (see
    `paired`: a pair with a threshold runs until its verdict is settled). Rank 0 calls
    `report(row)` as each pair finishes (`RowPrinter`)."""
    import warnings

    import torch.distributed as dist

    from partita.layout import Layout
    from partita.mesh import Mesh

    # The peers call collectives torch 2.13 deprecated; one warning per call and rank
    # would bury the table.
    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = Mesh(Layout(dp=world), rank, world)
    device = setup.rank_device(rank)
    # Drawn once: the per-name init costs seconds per billion parameters; copies are cheap.
    template, vocab = bench_model(setup.model, device)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (setup.batch, setup.seq + 1),
                             generator=gen).to(device) for _ in range(4)]

    def wait() -> None:  # a GPU runs behind the host: the clock waits for its queue
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out = []
    for ours, peer in pairs:
        steps = [build(name, copy.deepcopy(template), mesh) for name in (ours, peer)]
        first = []  # seconds of each side's first step: a compiled runner compiles in it
        for k in range(2):
            for i in range(setup.warmup):
                wait()
                t0 = time.perf_counter()
                steps[k](batches[i % 4])
                if i == 0:
                    wait()
                    first.append(time.perf_counter() - t0)

        times = _time_pair(steps, batches, setup, wait,
                           (thresholds or {}).get((ours, peer)))
        release(steps)
        out.append({"ours": ours, "peer": peer, "t_ours": times[0], "t_peer": times[1],
                    "first_ours": first[0], "first_peer": first[1],
                    "estimate": paired.estimate_times(times)})
        if report is not None and rank == 0:
            report(out[-1])
    return out


def _time_pair(steps: list[Step], batches: list[torch.Tensor], setup: Setup,
               wait: Callable[[], None],
               threshold: float | None) -> tuple[list[float], list[float]]:
    def time_side(k: int) -> float:
        wait()
        t0 = time.perf_counter()
        for i in range(setup.steps):
            steps[k](batches[i % 4])
        wait()
        took = paired.slowest_rank(time.perf_counter() - t0, batches[0].device)
        return took / setup.steps

    return paired.paired_rounds(time_side, setup.rounds, setup.max_rounds, threshold)


def table_row(r: dict, world: int, label: str = "") -> str:
    est = r["estimate"]
    return (f"{world:>5} {r['ours']:>18} {statistics.median(r['t_ours']) * 1e3:>9.1f} "
            f"{r['peer']:>26} {statistics.median(r['t_peer']) * 1e3:>9.1f} "
            f"{est.median:>7.3f} {est.span:>13} {est.rounds:>6}"
            + (f"  {label}" if label else ""))


@dataclass(frozen=True)
class RowPrinter:
    """`time_pairs`' report: prints a pair's table row the moment it is measured
    (flushed: the parent's output and the ranks' share one file). Picklable, for the
    worker processes; `labels` names the rows of some pairs."""
    world: int
    labels: tuple[tuple[tuple[str, str], str], ...] = ()

    def __call__(self, row: dict) -> None:
        label = dict(self.labels).get((row["ours"], row["peer"]), "")
        print(table_row(row, self.world, label), flush=True)


def is_peer(name: str) -> bool:
    """Another system's runner, as opposed to one of ours timed against another."""
    return not name.startswith("partita")


def transport() -> str:
    """How partita's ranks move data here: gloo, with its flat collectives (from
    PARTITA_SHM_MIN_BYTES where set; with none set its all-to-alls and pipeline transfers
    too) through shared memory unless PARTITA_SHM_COLLECTIVES=0 (the peers use gloo)."""
    if shm_share.wanted(None) and shm_share.supported():
        floor = shm_collectives.floor_bytes()
        size = f"{floor >> 20} MiB" if floor % (1 << 20) == 0 else f"{floor} bytes"
        which = "" if floor == 0 else f" of {size} and more"
        # All-to-alls and pipeline transfers use shared memory only where no floor is set.
        rest = ", all-reduces, all-to-alls and pipeline transfers" if floor == 0 else " and all-reduces"
        return (f"gloo (partita's gathers, reduce-scatters{rest}{which} through shared "
                "memory)")
    return "gloo"


def describe(bench: str, setup: Setup, targets: str = "1.0") -> str:
    """The table's header line; `targets`: the values a pair's interval is timed until it
    clears."""
    return (f"{bench}: {setup.model}, {setup.batch}x{setup.seq} tokens per rank, "
            f"{transport()}, "
            f"1 thread per rank, {setup.warmup} warm-up steps, then interleaved rounds of "
            f"{setup.steps} steps ({setup.rounds}, doubled up to {setup.max_rounds} where "
            f"the 99% interval of a peer pair's ratio still spans {targets}); median step "
            "times")


TABLE_HEAD = (f"{'world':>5} {'partita':>18} {'ms/step':>9} {'peer':>26} {'ms/step':>9} "
              f"{'ratio':>7} {'interval':>13} {'rounds':>6}")


def print_table(rows: list[dict], world: int) -> None:
    """`bench dp`'s table of `time_pairs`' rows, after the run: the legend of its
    intervals (where one is not a 99% one) above the column heads, so that the last row
    stays right above the verdict line."""
    paired.print_legend(r["estimate"] for r in rows)
    print(TABLE_HEAD)
    for r in rows:
        print(table_row(r, world))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=count, default=2, help="ranks (default 2, gloo)")
    parser.add_argument("--model", type=model_name, default=Setup.model,
                        help=f"{', '.join(CHOICES)} (a transformers LlamaForCausalLM) or any "
                        f"catalog model (default {Setup.model})")
    parser.add_argument("--batch", type=count, default=Setup.batch, help="sequences per rank")
    parser.add_argument("--seq", type=count, default=Setup.seq)
    parser.add_argument("--rounds", type=count, default=Setup.rounds,
                        help="timed rounds per pair, at least")
    # 160 (four looks from 16 or 20): on this 2-core machine the 99% interval is then
    # about +-2% wide (stage 0 vs DDP: 0.993-1.029); a pair closer than that stays
    # open, and the table shows it.
    parser.add_argument("--max-rounds", type=count, default=160,
                        help="rounds a close pair may double up to (default 160)")


def setup_from(args: argparse.Namespace) -> Setup:
    return Setup(model=args.model, batch=args.batch, seq=args.seq, rounds=args.rounds,
                 max_rounds=max(args.rounds, args.max_rounds))


def run(args: argparse.Namespace) -> int:
    setup = setup_from(args)
    pair = ("partita stage 0", "torch DDP")
    print(describe("dp", setup), flush=True)
    rows = run_distributed(time_pairs, args.world, timeout=1800,
                           args=(setup, [pair], build_step, {pair: 1.0}))[0]
    print_table(rows, args.world)
    print(f"dp: partita/torch-ddp step-time ratio {rows[0]['estimate'].median:.3f}")
    return 0
