"""offload of optimizer states: partita's against DeepSpeed ZeRO-Offload, and to disk

One process, one thread, partita's Llama-style Transformer in float32, the same batch
each step (forward, loss, backward, optimizer step):

- partita `offload=optimizer` (ZeRO-2, partita.memory.offload) against DeepSpeed
  ZeRO-2 with `offload_optimizer: cpu` (its DeepSpeedCPUAdam; DeepSpeed JIT-builds its
  `cpu_adam` op with ninja on first use, a few minutes, cached afterwards): paired
  alternating rounds (partita.bench.paired), median ratio with its 99% interval;
- partita without offload and with `offload=optimizer+disk` (partita.memory.disk, files
  in `--dir`, host buffers within `--budget-gb`): tokens/s of each, and the bytes the
  disk step moves per second of its pipeline of reads, updates and writes, against
  this directory's sequential bandwidth measured here the same way (buffered
  `pwrite`/`pread` of as many bytes in 8 MiB blocks); the synced, cold-cache figure is
  printed beside it: the engine does not bypass or sync the page cache, so on a
  machine with memory to spare its files are served from memory.

DeepSpeed's NVMe offload needs the libaio headers to build its `async_io` op; this
benchmark does not install system packages, so that peer is reported as not run.

Last line: `offload: worst partita/peer step-time ratio R; disk offload at B% of
sequential disk bandwidth` (targets R <= 1.0, B >= 70%).
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

from partita.bench.paired import estimate_times, paired_rounds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-rounds", type=int, default=24)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of the disk runs")
    parser.add_argument("--dir", default="", help="offload directory (default: a temporary one)")
    parser.add_argument("--budget-gb", type=float, default=0.02,
                        help="host memory budget of the disk offload engine")
    parser.add_argument("--peer", choices=("deepspeed", "none"), default="deepspeed",
                        help="none: partita's own modes only (no DeepSpeed build)")


def _config(args: argparse.Namespace, offload: str, directory: str):
    from partita.config import Config

    cfg = Config()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = args.dim, args.layers, 8
    cfg.model.n_kv_heads, cfg.model.vocab_size = 8, 512
    cfg.model.max_seq_len = cfg.data.seq_len = args.seq
    cfg.train.global_batch, cfg.train.microbatches = args.batch, 1
    cfg.train.dtype, cfg.train.lr = "float32", 1e-3
    cfg.parallel.zero_stage, cfg.parallel.offload = 2, offload
    cfg.parallel.offload_dir, cfg.parallel.host_memory_budget_gb = directory, args.budget_gb
    return cfg


def _partita(args: argparse.Namespace, offload: str, directory: str):
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model

    cfg = _config(args, offload, directory)
    pm = build_parallel_model(cfg, Mesh(cfg.layout(1).degrees, 0, 1), torch.device("cpu"))

    def step(tokens: torch.Tensor) -> float:
        start = time.perf_counter()
        pm.runner.train(tokens[:, :-1], tokens[:, 1:], 1)
        pm.dp.step()
        pm.dp.zero_grad()
        return time.perf_counter() - start
    return pm, step


def _deepspeed(args: argparse.Namespace):
    """DeepSpeed ZeRO-2 with the optimizer on the CPU around the same model, or None
    and the reason it could not run."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import torch.distributed as dist

        from partita.local_world import free_port
        from partita.models.transformer import build_model

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


def sequential_bandwidth(directory: str, nbytes: int, cold: bool, repeats: int = 3,
                         block: int = 8 << 20) -> float:
    """Bytes/s of rewriting then reading back a file of `nbytes` in `block`-byte pieces,
    the best of `repeats`. Warm (`cold=False`): buffered, the file written once before,
    as the disk engine rewrites its files every step; cold: the writes synced and the
    page cache dropped before the reads (the device itself, not the cache before it)."""
    buf = bytearray(os.urandom(block))
    path = os.path.join(directory, "bandwidth.probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    best = 0.0
    try:
        for off in range(0, nbytes, block):
            os.pwrite(fd, buf, off)
        for _ in range(repeats):
            start = time.perf_counter()
            for off in range(0, nbytes, block):
                os.pwrite(fd, buf, off)
            if cold:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            for off in range(0, nbytes, block):
                os.preadv(fd, [buf], off)
            best = max(best, 2 * nbytes / (time.perf_counter() - start))
    finally:
        os.close(fd)
        os.unlink(path)
    return best


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
    peer, peer_name = _deepspeed(args) if args.peer == "deepspeed" else (None, "--peer none")
    worst = float("nan")
    if peer is None:
        print(f"DeepSpeed ZeRO-Offload could not run here: {peer_name}")
    else:
        for side in (ours, peer):
            side(tokens)  # warm-up
        sides = (ours, peer)
        times = paired_rounds(lambda k: sides[k](tokens), args.rounds, args.max_rounds,
                              threshold=1.0)
        est = estimate_times(times)
        worst = est.median
        print(f"{'host offload':<22} partita {statistics.median(times[0]) * 1e3:8.1f} ms  "
              f"{peer_name} {statistics.median(times[1]) * 1e3:8.1f} ms  ratio "
              f"{est.median:.3f} ({est.span}, {est.rounds} rounds)")
    print("DeepSpeed NVMe offload: not run (its async_io op needs the libaio headers, which "
          "this benchmark does not install)")
    tokens_per_step = args.batch * args.seq
    rates = {}
    for mode in ("none", "optimizer", "optimizer+disk"):
        pm, step = _partita(args, mode, directory)
        step(tokens)
        took = [step(tokens) for _ in range(args.steps)]
        rates[mode] = tokens_per_step / statistics.median(took)
        if mode == "optimizer+disk":
            disk = pm.dp.disk
            moved = disk.bytes_read + disk.bytes_written
            disk_rate = moved / disk.seconds
            per_step = moved / (args.steps + 1)
    size = max(int(per_step), 64 << 20)
    seq_bw = sequential_bandwidth(directory, size, cold=False)
    cold_bw = sequential_bandwidth(directory, size, cold=True)
    share = disk_rate / seq_bw
    print(f"tokens/s: in memory {rates['none']:,.0f}, host offload {rates['optimizer']:,.0f}, "
          f"disk offload {rates['optimizer+disk']:,.0f} "
          f"({rates['optimizer+disk'] / rates['none']:.2f} of in memory)")
    print(f"disk offload moved {per_step / 1e6:.1f} MB per step at {disk_rate / 1e6:.0f} MB/s "
          f"(reads + writes over the step's disk pipeline); sequential bandwidth here, "
          f"buffered as the engine's I/O: {seq_bw / 1e6:.0f} MB/s (synced, cache dropped: "
          f"{cold_bw / 1e6:.0f} MB/s; files this small stay in the page cache)")
    print(f"offload: worst partita/peer step-time ratio {worst:.3f}; disk offload at "
          f"{share * 100:.0f}% of sequential disk bandwidth")
    return 0
