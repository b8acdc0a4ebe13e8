"""offload of optimizer states: partita's against DeepSpeed ZeRO-Offload, and to disk

One process, one thread, partita's Llama-style Transformer in float32, the same batch
each step (forward, loss, backward, optimizer step):

- partita `offload=optimizer` (ZeRO-2, partita.memory.offload) against DeepSpeed
  ZeRO-2 with `offload_optimizer: cpu` (its DeepSpeedCPUAdam; DeepSpeed JIT-builds its
  `cpu_adam` op with ninja on first use, a few minutes, cached afterwards): paired
  alternating rounds (partita.bench.paired), median ratio with its 99% interval (below
  8 rounds the range of the rounds, labelled as such);
- partita without offload and with `offload=optimizer+disk` (partita.memory.disk, files
  in `--dir`, host buffers within `--budget-gb`): tokens/s of each; and, in
  alternating rounds, the bytes one disk step moves per second of its pipeline of
  reads, updates and writes against this directory's sequential bandwidth measured
  right after it: writing then reading back as many bytes in 8 MiB blocks, through
  O_DIRECT as the engine's full records are (buffered where the file system refuses
  it, as the engine then is). The disk runs the larger of `--rounds` and twice
  `--steps` rounds (the line says so where that is more than `--rounds`). B is the median
  of the rounds' ratios, with its interval (the disk is shared; single readings swing
  by 2x); the line also gives the two rates' own medians and their ratio, which need
  not equal B (a median of ratios is not a ratio of medians).

- partita ZeRO-3 `offload=optimizer+disk` against DeepSpeed ZeRO-3 with
  `offload_optimizer: nvme` (its files in the same directory), paired rounds. Its
  `async_io` op JIT-builds against the libaio headers, which the machine must have
  (`apt-get install libaio-dev`; this benchmark installs no system packages itself);
  where they are missing, or the build fails, that pair is reported as not run. The
  build takes minutes (about 50 on a loaded 2-core machine) and is cached; a build
  killed midway leaves a `lock` file in its torch_extensions folder that makes the
  next one wait forever: delete it.

Last line: `offload: worst partita/peer step-time ratio R; disk offload at B% of
sequential disk bandwidth` (targets R <= 1.0, B >= 70%); R is `n/a (no peer ran)`
where neither DeepSpeed pair ran (`--peer none`, or DeepSpeed could not run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from partita.arg_types import count
from partita.bench.paired import estimate_times, paired_rounds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=count, default=256)
    parser.add_argument("--layers", type=count, default=4)
    parser.add_argument("--seq", type=count, default=128)
    parser.add_argument("--batch", type=count, default=4)
    parser.add_argument("--rounds", type=count, default=6,
                        help="paired rounds (the disk share runs at least twice --steps)")
    parser.add_argument("--max-rounds", type=count, default=24)
    parser.add_argument("--steps", type=count, default=5, help="timed steps of the disk runs")
    parser.add_argument("--dir", default="", help="offload directory (default: a temporary one)")
    parser.add_argument("--budget-gb", type=float, default=0.02,
                        help="host memory budget of the disk offload engine")
    parser.add_argument("--peer", choices=("deepspeed", "none"), default="deepspeed",
                        help="none: partita's own modes only (no DeepSpeed build)")


def _config(args: argparse.Namespace, offload: str, directory: str, stage: int = 2):
    from partita.config import Config

    cfg = Config()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = args.dim, args.layers, 8
    cfg.model.n_kv_heads, cfg.model.vocab_size = 8, 512
    cfg.model.max_seq_len = cfg.data.seq_len = args.seq
    cfg.train.global_batch, cfg.train.microbatches = args.batch, 1
    cfg.train.dtype, cfg.train.lr = "float32", 1e-3
    cfg.parallel.zero_stage, cfg.parallel.offload = stage, offload
    cfg.parallel.offload_dir, cfg.parallel.host_memory_budget_gb = directory, args.budget_gb
    return cfg


def _partita(args: argparse.Namespace, offload: str, directory: str, stage: int = 2):
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model

    cfg = _config(args, offload, directory, stage)
    pm = build_parallel_model(cfg, Mesh(cfg.layout(1).degrees, 0, 1), torch.device("cpu"))

    def step(tokens: torch.Tensor) -> float:
        start = time.perf_counter()
        pm.runner.train(tokens[:, :-1], tokens[:, 1:], 1)
        pm.dp.step()
        pm.dp.wait_params()  # the update's tail, else it would run in the peer's turn
        pm.dp.zero_grad()
        return time.perf_counter() - start
    return pm, step


def _deepspeed(args: argparse.Namespace, nvme_dir: str = ""):
    """DeepSpeed ZeRO-2 with the optimizer on the CPU around the same model (with
    `nvme_dir`: ZeRO-3 with the optimizer's states in files there, its NVMe offload),
    or None and the reason it could not run."""
    try:
        import torch.distributed as dist

        from partita.bench.deepspeed_peer import import_deepspeed
        from partita.local_world import free_port
        from partita.models.transformer import build_model

        deepspeed = import_deepspeed()
        if not dist.is_initialized():
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                              RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            deepspeed.init_distributed(dist_backend="gloo")
        model = build_model(_config(args, "none", "").model_config())
        ds_cfg = {"train_micro_batch_size_per_gpu": args.batch,
                  "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {
                      "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
        if nvme_dir:
            from deepspeed.ops.op_builder.cpu.async_io import AsyncIOBuilder

            AsyncIOBuilder().load()  # JIT-built once; needs the libaio headers
            ds_cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {
                "device": "nvme", "nvme_path": nvme_dir, "pin_memory": False}}
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_cfg,
                                               model_parameters=model.parameters())
    except Exception as exc:  # report, do not fail the whole benchmark
        return None, f"{type(exc).__name__}: {exc}"

    def step(tokens: torch.Tensor) -> float:
        start = time.perf_counter()
        logits = engine(tokens[:, :-1])
        engine.backward(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
        engine.step()
        return time.perf_counter() - start
    return step, f"deepspeed {deepspeed.__version__}"


def sequential_bandwidth(directory: str, nbytes: int, direct: bool,
                         block: int = 8 << 20) -> float:
    """Bytes/s of writing then reading back a file of `nbytes` in `block`-byte pieces,
    through O_DIRECT when `direct` (the page cache bypassed, as the disk engine's
    records), and with the writes synced either way."""
    from partita.memory.disk import _aligned

    buf = _aligned(block)
    buf.copy_(torch.randint(256, (block,), dtype=torch.uint8))
    view = memoryview(buf.numpy())
    path = os.path.join(directory, "bandwidth.probe")
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    nbytes = -(-nbytes // block) * block
    try:
        start = time.perf_counter()
        for off in range(0, nbytes, block):
            os.pwritev(fd, [view], off)
        os.fsync(fd)
        for off in range(0, nbytes, block):
            os.preadv(fd, [view], off)
        return 2 * nbytes / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    directory = args.dir or tempfile.mkdtemp(prefix="partita-offload-")
    try:
        return _run(args, directory)
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)


def _run(args: argparse.Namespace, directory: str) -> int:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(512, (args.batch, args.seq + 1), generator=gen)
    print(f"offload: llama dim={args.dim} layers={args.layers} seq={args.seq} "
          f"batch={args.batch}, float32, ZeRO-2, 1 process, 1 thread; disk: {directory}, "
          f"host budget {args.budget_gb} GB")
    _, ours = _partita(args, "optimizer", "")
    worst: float | None = None  # the worst ratio of the peer pairs that ran
    if args.peer != "deepspeed":
        print("DeepSpeed ZeRO-Offload: not run, skipped by request (--peer none)")
        peer = None
    else:
        peer, peer_name = _deepspeed(args)
        if peer is None:
            print(f"DeepSpeed ZeRO-Offload could not run here: {peer_name}")
    if peer is not None:
        for side in (ours, peer):
            side(tokens)  # warm-up
        sides = (ours, peer)
        times = paired_rounds(lambda k: sides[k](tokens), args.rounds, args.max_rounds,
                              threshold=1.0)
        est = estimate_times(times)
        worst = est.median
        print(f"{'host offload':<22} partita {statistics.median(times[0]) * 1e3:8.1f} ms  "
              f"{peer_name} {statistics.median(times[1]) * 1e3:8.1f} ms  ratio "
              f"{est.median:.3f} ({est.described})")
    if args.peer == "deepspeed":
        worst = _against_nvme(args, directory, tokens, worst)
    else:
        print("DeepSpeed NVMe offload: not run, skipped by request (--peer none)")
    tokens_per_step = args.batch * args.seq
    rates = {}
    for mode in ("none", "optimizer", "optimizer+disk"):
        pm, step = _partita(args, mode, directory)
        step(tokens)
        took = [step(tokens) for _ in range(args.steps)]
        rates[mode] = tokens_per_step / statistics.median(took)
    disk = pm.dp.disk
    share, pipe, seq = _disk_share(args, disk, lambda: step(tokens), directory)
    print(f"tokens/s: in memory {rates['none']:,.0f}, host offload {rates['optimizer']:,.0f}, "
          f"disk offload {rates['optimizer+disk']:,.0f} "
          f"({rates['optimizer+disk'] / rates['none']:.2f} of in memory)")
    rounds = _disk_rounds(args)
    why = "" if rounds == args.rounds else \
        f"; {rounds} rounds, not --rounds {args.rounds}: the disk runs at least twice --steps"
    print(f"disk offload ({'O_DIRECT' if disk.direct else 'buffered'} records of "
          f"{disk.subgroup * 3 * disk.dtype.itemsize / 1e6:.1f} MB): moved "
          f"{pipe[1] / 1e6:.1f} MB per step at median {pipe[0] / 1e6:.0f} MB/s over the "
          f"step's read-update-write pipeline; sequential bandwidth here, measured after "
          f"each step the same way: median {seq / 1e6:.0f} MB/s (ratio of these medians "
          f"{pipe[0] / seq:.3f}); median of the per-round pipeline/sequential ratios "
          f"{share.median:.3f} ({share.described}){why}")
    print(f"offload: worst partita/peer step-time ratio "
          f"{'n/a (no peer ran)' if worst is None else f'{worst:.3f}'}; disk offload at "
          f"{share.median * 100:.0f}% of sequential disk bandwidth")
    return 0


def _disk_rounds(args: argparse.Namespace) -> int:
    """Rounds of the disk share: `--rounds`, but at least twice `--steps`."""
    return max(args.rounds, 2 * args.steps)


def _against_nvme(args: argparse.Namespace, directory: str, tokens: torch.Tensor,
                  worst: float | None) -> float | None:
    """Ours, ZeRO-3 `optimizer+disk`, against DeepSpeed ZeRO-3 with its optimizer
    offloaded to NVMe, files in the same directory: paired rounds; the worse ratio."""
    nvme = os.path.join(directory, "deepspeed")
    os.makedirs(nvme, exist_ok=True)
    peer, name = _deepspeed(args, nvme)
    if peer is None:
        print(f"DeepSpeed NVMe offload could not run here: {name}")
        return worst
    ours_dir = os.path.join(directory, "partita")
    os.makedirs(ours_dir, exist_ok=True)
    _, ours = _partita(args, "optimizer+disk", ours_dir, stage=3)
    sides = (ours, peer)
    for side in sides:
        side(tokens)  # warm-up
    times = paired_rounds(lambda k: sides[k](tokens), args.rounds, args.max_rounds,
                          threshold=1.0)
    est = estimate_times(times)
    print(f"{'disk offload (ZeRO-3)':<22} partita {statistics.median(times[0]) * 1e3:8.1f} ms  "
          f"{name} NVMe {statistics.median(times[1]) * 1e3:8.1f} ms  ratio "
          f"{est.median:.3f} ({est.described})")
    return est.median if worst is None else max(worst, est.median)


def _disk_share(args: argparse.Namespace, disk, step, directory: str):
    """Alternating rounds of one disk step and one sequential probe of as many bytes:
    the estimate of the ratio of their rates, the pipeline's median rate and bytes per
    step, and the probe's median rate."""
    from partita.bench.paired import estimate

    ratios, pipes, seqs = [], [], []
    for _ in range(_disk_rounds(args)):
        moved, seconds = disk.bytes_read + disk.bytes_written, disk.seconds
        step()
        moved, seconds = disk.bytes_read + disk.bytes_written - moved, disk.seconds - seconds
        pipes.append(moved / seconds)
        seqs.append(sequential_bandwidth(directory, moved // 2, disk.direct))
        ratios.append(pipes[-1] / seqs[-1])
    return estimate(ratios), (statistics.median(pipes), moved), statistics.median(seqs)
