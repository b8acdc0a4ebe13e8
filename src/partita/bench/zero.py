"""ZeRO stages against their peers, same model, world size and batches, in one run.

    stage 0  vs  torch DistributedDataParallel
    stage 1  vs  torch ZeroRedundancyOptimizer (under DDP), DeepSpeed ZeRO-1
    stage 2  vs  FSDP2 fully_shard(reshard_after_forward=False), DeepSpeed ZeRO-2
    stage 3  vs  FSDP2 fully_shard(reshard_after_forward=True), DeepSpeed ZeRO-3

DeepSpeed rows appear where `deepspeed` is installed (an optional extra; on CPU:
`DS_BUILD_OPS=0 pip install deepspeed`); it runs on its CPU accelerator with torch's
fused AdamW, as the torch peers do (`dp.torch_adamw`). Every pair is timed as in
`partita bench dp` (warm-up, then alternating rounds, median of per-round ratios with
its 99% interval; a pair whose interval still spans its target gets more rounds). S
times our own stage 3 against our stage 2 the same way: the price of sharding
parameters. A last pair times stage 0 against itself: how far from
1.0 a ratio strays on this machine when nothing differs (the noise floor of the table).
S is measured at the default unit size (bucket_mb: the tiny model's blocks make one
gather unit), on its own row with one gather unit per block, and on another with every
unit kept gathered from forward into backward (`parallel.keep_gathered` at least the
unit count: FSDP2's reshard_after_forward=False, more memory for no second gather).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

import torch

from partita.arg_types import count, several
from partita.bench import dp as harness
from partita.bench import paired
from partita.bench.deepspeed_peer import check_build_locks, import_deepspeed
from partita.bench.models import blocks_of
from partita.errors import PartitaError
from partita.local_world import run_distributed


def _fsdp2_step(model, mesh, reshard: bool) -> harness.Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device_mesh = init_device_mesh("cpu", (mesh.world_size,))
    for block in blocks_of(model):
        fully_shard(block, mesh=device_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=device_mesh, reshard_after_forward=reshard)
    return harness.torch_step(model, harness.torch_adamw(model.parameters()))


def _zero_redundancy_step(model, mesh) -> harness.Step:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                  **harness.TORCH_ADAMW)
    return harness.torch_step(ddp, opt)


def _deepspeed_step(model, mesh, stage: int, batch: int) -> harness.Step:
    import logging

    from partita.zero import ZeroConfig

    deepspeed = import_deepspeed()  # in the benchmark's own worker processes only

    deepspeed.utils.logger.setLevel(logging.WARNING)
    # DeepSpeed's buckets default to 5e8 elements, a 2 GB fp32 buffer per rank sized for
    # GPUs (4 ranks of llama-100m ran out of 24 GiB): it gets the 25 MiB that partita's
    # and DDP's buckets hold.
    bucket = ZeroConfig().bucket_bytes // 4
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                    "allgather_bucket_size": bucket},
              "gradient_clipping": harness.CLIP,
              "optimizer": {"type": "AdamW",
                            "params": {**harness.TORCH_ADAMW, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)

    def step(tokens: torch.Tensor) -> None:
        engine.backward(harness._loss(engine(tokens[:, :-1]), tokens))
        engine.step()
    # Removes the hooks DeepSpeed put on the parameters: held by autograd in C++, they
    # kept every engine alive to the end of the run. (A ZeRO-3 engine still outlives
    # its pair, held from outside Python's reach; `pairs` times it last.)
    step.release = engine.destroy
    return step


def build_step(name: str, model: torch.nn.Module, mesh) -> harness.Step:
    kind, _, arg = name.rpartition(" ")
    if kind == "partita stage":
        return harness.partita_step(model, mesh, int(arg))
    if name == PER_BLOCK:  # a unit size below any block: one gather unit per block
        return harness.partita_step(model, mesh, 3, bucket_mb=1e-6)
    if name == KEEP_ALL:  # more kept units than any model here has
        return harness.partita_step(model, mesh, 3, keep_gathered=1024)
    if name == "torch DDP":
        return harness.ddp_step(model, mesh)
    if name == "torch ZeroRedundancyOpt":
        return _zero_redundancy_step(model, mesh)
    if kind == "FSDP2 reshard":
        return _fsdp2_step(model, mesh, arg == "True")
    if kind == "DeepSpeed ZeRO":
        return _deepspeed_step(model, mesh, int(arg), _BATCH[0])
    raise ValueError(name)


_BATCH = [harness.Setup.batch]  # DeepSpeed's config needs it; set per worker in _worker


def _worker(rank: int, world: int, setup: harness.Setup, pairs,
            report: harness.RowPrinter | None = None) -> list[dict]:
    _BATCH[0] = setup.batch
    return harness.time_pairs(rank, world, setup, pairs, build_step, thresholds(pairs),
                              report)


# The goal for S: sharding the parameters costs at most 5% of stage 2's step time.
S_TARGET = 1.05


def thresholds(pairs: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
    """The verdict each pair is timed until it settles (see `paired`): 1.0 against a
    peer, the S target for stage 3 against stage 2; the other rows are informative."""
    out = {pair: 1.0 for pair in pairs if harness.is_peer(pair[1])}
    out[STAGE3_VS_STAGE2] = S_TARGET
    return out


PEER_KINDS = ("torch", "deepspeed", "partita")


def pairs(with_deepspeed: bool, stages: tuple[int, ...] = (0, 1, 2, 3),
          peers: tuple[str, ...] = PEER_KINDS) -> list[tuple[str, str]]:
    """The pairs to time, in order: those of `stages` (a pair belongs to the stage of our
    side; the S rows to stage 3, the noise row to stage 0) whose other side is of one of
    the `PEER_KINDS` in `peers` (partita's own for S and the noise row)."""
    out = [("partita stage 0", "torch DDP"),
           ("partita stage 1", "torch ZeroRedundancyOpt"),
           ("partita stage 2", "FSDP2 reshard False"),
           ("partita stage 3", "FSDP2 reshard True"),
           # Not peers: our stage 3 against our stage 2 (S), and stage 0 against itself.
           STAGE3_VS_STAGE2, PER_BLOCK_VS_STAGE2, KEEP_ALL_VS_STAGE2, SELF_PAIR,
           # DeepSpeed last: its engines stayed alive in the process after their pair (the
           # S pair measured after them ran 4-9% slower on both sides), ZeRO-3's still do.
           ("partita stage 1", "DeepSpeed ZeRO 1"), ("partita stage 2", "DeepSpeed ZeRO 2"),
           ("partita stage 3", "DeepSpeed ZeRO 3")]
    return [pair for pair in out if (with_deepspeed or not pair[1].startswith("DeepSpeed"))
            and _stage_of(pair[0]) in stages and _kind_of(pair[1]) in peers]


def _kind_of(peer: str) -> str:
    return next((kind for kind in PEER_KINDS[1:] if peer.lower().startswith(kind)), "torch")


def _stage_of(ours: str) -> int:
    return 3 if ours in (PER_BLOCK, KEEP_ALL) else int(ours.removeprefix("partita stage "))


STAGE3_VS_STAGE2 = ("partita stage 3", "partita stage 2")
PER_BLOCK = "stage 3 per block"
PER_BLOCK_VS_STAGE2 = (PER_BLOCK, "partita stage 2")
KEEP_ALL = "stage 3 keep all"
KEEP_ALL_VS_STAGE2 = (KEEP_ALL, "partita stage 2")
SELF_PAIR = ("partita stage 0", "partita stage 0")
LABELS = ((STAGE3_VS_STAGE2, "(S)"),
          (PER_BLOCK_VS_STAGE2, "(S with one gather unit per block)"),
          (KEEP_ALL_VS_STAGE2, "(S with every unit kept gathered into backward)"),
          (SELF_PAIR, "(noise: same run twice)"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_arguments(parser)
    # At least 20 rounds: with 6, stage 0 timed against itself strayed up to 4% from 1.0
    # at 4 ranks, with 10 up to 6%. Pairs whose verdict is still open double from there.
    parser.set_defaults(rounds=20)
    parser.add_argument("--worlds", **several(count), default=[2, 4],
                        help="world sizes to run (default 2 4)")
    parser.add_argument("--no-deepspeed", action="store_true",
                        help="skip DeepSpeed even where it is installed")
    parser.add_argument("--stages", **several(int, choices=(0, 1, 2, 3)),
                        default=[0, 1, 2, 3],
                        help="the stages whose rows to time (default all; S is a stage 3 "
                             "row, the noise row a stage 0 one)")
    parser.add_argument("--peers", **several(str, choices=PEER_KINDS),
                        default=list(PEER_KINDS),
                        help="whose runners to time ours against (default all): torch's "
                             "(DDP, ZeroRedundancyOptimizer, FSDP2), DeepSpeed's, or "
                             "partita's own (the S rows and the noise row)")


def run(args: argparse.Namespace) -> int:
    setup = dataclasses.replace(harness.setup_from(args), steps=2)
    installed = importlib.util.find_spec("deepspeed") is not None
    with_ds = installed and not args.no_deepspeed
    chosen = pairs(with_ds, tuple(args.stages), tuple(args.peers))
    if any(peer.startswith("DeepSpeed") for _, peer in chosen):
        check_build_locks()  # here, once, rather than as every rank waits on it
    if not chosen:
        raise PartitaError(
            f"no pair to time: --stages {' '.join(map(str, args.stages))} has no rows "
            f"against --peers {' '.join(args.peers)}"
            + ("" if with_ds else " with DeepSpeed's rows skipped") + "; widen either.")
    print(harness.describe("zero", setup, f"1.0, of S {S_TARGET}")
          + ("" if with_ds else "; DeepSpeed rows skipped ("
             + ("--no-deepspeed)" if installed else "not installed)")))
    # Rows appear as their pairs finish, in the order of `pairs`.
    print(harness.TABLE_HEAD, flush=True)
    worst, worst_s = 0.0, 0.0
    estimates = []
    for world in args.worlds:
        rows = run_distributed(_worker, world, timeout=3600,
                               args=(setup, chosen, harness.RowPrinter(world, LABELS)))[0]
        estimates += [r["estimate"] for r in rows]
        worst = max([worst, *(r["estimate"].median for r in rows
                              if harness.is_peer(r["peer"]))])
        by_pair = {(r["ours"], r["peer"]): r for r in rows}
        if STAGE3_VS_STAGE2 in by_pair:
            worst_s = max(worst_s, by_pair[STAGE3_VS_STAGE2]["estimate"].median)
    paired.print_legend(estimates)
    s = f"{worst_s:.3f}" if STAGE3_VS_STAGE2 in chosen else "not run (--stages, --peers)"
    w = f"{worst:.3f}" if any(harness.is_peer(p) for _, p in chosen) else "not run (--peers)"
    print(f"zero: worst partita/peer step-time ratio {w}; stage3/stage2 ratio {s}")
    return 0
