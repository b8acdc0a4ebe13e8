"""GPUs: partita's ZeRO stages against torch's in bf16 mixed precision, with MFU.

`partita bench zero` compares the algorithms on CPU processes; this compares what the
engine costs where models train: CUDA, NCCL, bf16 compute with fp32 master weights and
a published 1B shape (Llama 3.2 1B) by default. One rank per visible GPU (NCCL takes
one rank per GPU; on a single GPU the collectives are local copies, so the table is the
engines' own overhead, not communication). Pairs, timed as in `partita bench dp`:

    stage 0  vs  torch DDP under autocast(bf16): fp32 parameters, bf16 matmuls
    stage 2  vs  FSDP2 fully_shard(reshard_after_forward=False)
    stage 3  vs  FSDP2 fully_shard(reshard_after_forward=True)
    stage 0  vs  itself (the noise floor)

Both sides keep fp32 master weights and AdamW states, compute in bf16 and reduce
gradients in fp32 (FSDP2's MixedPrecisionPolicy(bf16, fp32)); the loss is computed on
fp32 logits everywhere. MFU counts 6N + attention FLOPs per token
(`ModelConfig.flops_per_token`) against the GPU's dense bf16 datasheet peak.

`--compile` times partita's compile modes against the same stage eager instead
(`COMPILE_PAIRS`: stage 0 and 3 blocks, stage 0 model) and reports each side's first
step, which holds the compilation; `--profile RUNNER` then profiles one runner and prints
its top kernels by device time (the CPU test of both
paths: tests/dist/test_bench_harness.py).
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable

import torch

from partita.arg_types import at_least, count
from partita.bench import dp as harness
from partita.bench import paired
from partita.bench.models import blocks_of, model_name
from partita.errors import PartitaError
from partita.local_world import run_distributed

BF16 = torch.bfloat16


def partita_bf16(model, mesh, stage: int) -> harness.Step:
    """partita's stage `stage` in bf16 with fp32 master weights and fp32 reduction."""
    from partita.zero import MixedPrecision

    return harness.partita_step(model, mesh, stage,
                                precision=MixedPrecision(param_dtype=BF16,
                                                         reduce_dtype=torch.float32))


def ddp_autocast(model, mesh) -> harness.Step:
    """DDP over fp32 parameters, the forward under autocast(bf16), clipped as partita's
    runner is (`harness.CLIP`)."""
    from torch.nn.parallel import DistributedDataParallel

    device_type = next(model.parameters()).device.type
    ddp = DistributedDataParallel(model)
    optimizer = harness.torch_adamw(ddp.parameters())

    def step(tokens: torch.Tensor) -> None:
        with torch.autocast(device_type, dtype=BF16):
            logits = ddp(tokens[:, :-1])
        harness._loss(logits, tokens).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), harness.CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def fsdp2_bf16(model, mesh, reshard: bool) -> harness.Step:
    """FSDP2 per block and at the root, MixedPrecisionPolicy(bf16, reduce fp32)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device_type = next(model.parameters()).device.type
    device_mesh = init_device_mesh(device_type, (mesh.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    for block in blocks_of(model):
        fully_shard(block, mesh=device_mesh, reshard_after_forward=reshard,
                    mp_policy=policy)
    fully_shard(model, mesh=device_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return harness.torch_step(model, harness.torch_adamw(model.parameters()))


def build_step(name: str, model: torch.nn.Module, mesh) -> harness.Step:
    """`partita stage N` (eager), `partita stage N blocks` (each block compiled, before
    the engine, as `train.compile=blocks` does), `partita stage 0 model` (the whole
    model compiled after the engine), or one of the peers."""
    words = name.split()
    if words[:2] == ["partita", "stage"]:
        from partita.compile import compile_block_modules, compile_model

        mode = words[3] if len(words) > 3 else "none"
        if mode == "blocks":
            compile_block_modules(blocks_of(model))
        step = partita_bf16(model, mesh, int(words[2]))
        if mode == "model":
            compile_model(step.engine.module)
        return step
    kind, _, arg = name.rpartition(" ")
    if name == "DDP autocast bf16":
        return ddp_autocast(model, mesh)
    if kind == "FSDP2 reshard":
        return fsdp2_bf16(model, mesh, arg == "True")
    raise ValueError(name)


PAIRS = [("partita stage 0", "DDP autocast bf16"),
         ("partita stage 2", "FSDP2 reshard False"),
         ("partita stage 3", "FSDP2 reshard True"),
         ("partita stage 0", "partita stage 0")]
# `--compile`: each compile mode against the same stage eager (`train.compile`).
# Blocks first: they compile one block's graph (then shared), the whole model 16 times
# as much code, so a short GPU lease gets the cheap rows before the expensive one.
COMPILE_PAIRS = [("partita stage 0 blocks", "partita stage 0"),
                 ("partita stage 3 blocks", "partita stage 3"),
                 ("partita stage 0 model", "partita stage 0")]


def _worker(rank: int, world: int, setup: harness.Setup, pairs: list[tuple[str, str]],
            profile: str, printer: Callable[[dict], None]) -> tuple[list[dict], int, str]:
    """Each pair in turn, its row printed as soon as it is timed, and the profile right
    after the first pair that holds the profiled runner: a GPU lease may end before the
    last pair, and what was measured by then is still on record."""
    rows, kernels = [], ""
    for pair in pairs:
        rows += harness.time_pairs(rank, world, setup, [pair], build_step,
                                   report=printer)
        if profile in pair and not kernels:
            kernels = top_kernels(rank, world, setup, profile)
            if rank == 0:
                print(f"top kernels of {profile} ({world} rank(s), rank 0):\n{kernels}",
                      flush=True)
    memory = torch.cuda.max_memory_allocated() if setup.device == "cuda" else 0
    return rows, memory, kernels


HEAD = (f"{'partita':>22} {'ms/step':>8} {'MFU':>6} {'peer':>20} {'ms/step':>8} "
        f"{'MFU':>6} {'ratio':>6} {'interval':>13} {'first step s':>13}")


def _mfu(seconds: float, flops_per_step: float, peak: float) -> float:
    """MFU of a step of `seconds` (0 where the GPU's peak is unknown)."""
    return flops_per_step / seconds / peak if peak else 0.0


def _print_row(r: dict, flops_per_step: float = 0.0, peak: float = 0.0) -> None:
    """One pair's row; MFU of a median step, and the two sides' first steps (a compiled
    runner's includes its compilation)."""
    def mfu(seconds: float) -> float:
        return _mfu(seconds, flops_per_step, peak)

    ours, theirs = statistics.median(r["t_ours"]), statistics.median(r["t_peer"])
    est = r["estimate"]
    print(f"{r['ours']:>22} {ours * 1e3:>8.1f} {mfu(ours):>6.1%} {r['peer']:>20} "
          f"{theirs * 1e3:>8.1f} {mfu(theirs):>6.1%} {est.median:>6.3f} {est.span:>13} "
          f"{r['first_ours']:>6.1f}/{r['first_peer']:<6.1f}", flush=True)


def top_kernels(rank: int, world: int, setup: harness.Setup, name: str,
                steps: int = 5, rows: int = 15) -> str:
    """The runner `name`'s kernels by their own device time over `steps` steps (after
    three unprofiled ones, which compile), as torch.profiler's table: where a step's
    time goes, and so what stands between its MFU and the GPU's peak."""
    from torch.profiler import ProfilerActivity, profile

    from partita.layout import Layout
    from partita.mesh import Mesh

    device = setup.rank_device(rank)
    model, vocab = harness.bench_model(setup.model, device)
    step = build_step(name, model, Mesh(Layout(dp=world), rank, world))
    tokens = torch.randint(0, vocab, (setup.batch, setup.seq + 1),
                           generator=torch.Generator().manual_seed(rank)).to(device)
    for _ in range(3):
        step(tokens)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    harness.release([step])
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=at_least(0), default=0,
                        help="ranks, one per GPU (default: every visible GPU)")
    parser.add_argument("--model", type=model_name, default="llama3.2-1b")
    parser.add_argument("--batch", type=count, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=count, default=2048)
    parser.add_argument("--rounds", type=count, default=8)
    parser.add_argument("--compile", action="store_true",
                        help="time the compile modes against eager (ZeRO 0 and 3) instead "
                        "of the peers")
    parser.add_argument("--profile", default="", metavar="RUNNER",
                        help="after the table, profile one runner (e.g. 'partita stage 0 "
                        "model') and print its top kernels by device time")


def run(args: argparse.Namespace) -> int:
    from partita.metrics import device_peak_flops
    from partita.models.catalog import get_model_config

    pairs = COMPILE_PAIRS if args.compile else PAIRS
    runners = list(dict.fromkeys(name for pair in pairs for name in pair))
    # Refusals are PartitaErrors: one `partita: error:` line, exit 2, as everywhere.
    if args.profile and args.profile not in runners:
        raise PartitaError(f"bench gpu: --profile {args.profile!r} is not a runner of this "
                           f"run; choose one of {', '.join(repr(n) for n in runners)}.")
    if not torch.cuda.is_available():
        raise PartitaError("bench gpu: no CUDA device is visible; this benchmark needs at "
                           "least one GPU (bench dp and bench zero measure on CPUs).")
    world = args.gpus or torch.cuda.device_count()
    if world > torch.cuda.device_count():
        raise PartitaError(f"bench gpu: --gpus {world} but {torch.cuda.device_count()} GPU(s) "
                           "are visible; NCCL runs one rank per GPU.")
    setup = harness.Setup(model=args.model, batch=args.batch, seq=args.seq,
                          rounds=args.rounds, device="cuda")
    cfg = get_model_config(setup.model)
    flops_per_step = cfg.flops_per_token(setup.seq) * setup.batch * setup.seq
    peak = device_peak_flops(torch.device("cuda", 0))
    name = torch.cuda.get_device_name(0)
    print(f"gpu: {setup.model}, {world} x {name}, NCCL, bf16 compute + fp32 master, "
          f"{setup.batch}x{setup.seq} tokens per rank, {setup.rounds} interleaved rounds "
          f"of {setup.steps} steps after {setup.warmup} warm-up steps; torch "
          f"{torch.__version__}; MFU against {peak / 1e12:.0f} TFLOP/s")
    print(HEAD, flush=True)
    printer = functools.partial(_print_row, flops_per_step=flops_per_step, peak=peak)
    rows, memory, _ = run_distributed(_worker, world, timeout=1800, backend="nccl",
                                      args=(setup, pairs, args.profile, printer))[0]
    paired.print_legend(r["estimate"] for r in rows)
    print(f"peak allocated on rank 0 over the run (two engines alive per pair): "
          f"{memory / 2**30:.1f} GiB")
    best_mfu = max(_mfu(statistics.median(r["t_ours"]), flops_per_step, peak) for r in rows)
    if args.compile:
        worst = max(r["estimate"].median for r in rows)
        print(f"gpu: worst compiled/eager step-time ratio {worst:.3f}; best partita MFU "
              f"{best_mfu:.1%}")
        return 0
    worst = max(r["estimate"].median for r in rows if harness.is_peer(r["peer"]))
    print(f"gpu: worst partita/peer step-time ratio {worst:.3f}; best partita MFU "
          f"{best_mfu:.1%}")
    return 0
