"""A hardware profile of this machine's CPU, measured by a short micro-benchmark.

Our tests and `partita bench` run one process per core with one thread each, talking
over gloo on loopback; this profile describes one such process as a "device", so the
planner can predict what those runs measure. The matmul and copy loops each stop
after a fixed time budget (well under two seconds together), and so does the eager-op
loop: forward and backward passes of partita's own model at a size where the kernels'
work is negligible, whose time over the operations they dispatch is what one eager
operation costs here (`planner.eager_ops` counts a step's operations).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

from partita.device_specs import GB, GPUSpec, best_rate, matmul_rate, training_matmul_rate
from partita.machine_cache import (
    KEPT_S,
    cpuinfo_value,
    kept_file,
    machine_key,
    meminfo_bytes,
    read_kept,
    write_kept,
)

# A profile measured by `partita plan --gpu-type cpu` is kept this long, so that the
# plans of one sitting agree (a shared machine's rates move by tens of percent from one
# minute to the next) and each call skips the measurement (~4 s with torch's import).
CACHE_MAX_AGE_S = KEPT_S
# How the profile is measured; a kept profile measured another way is measured again
# (2: bf16 products at the fp32 size; 3: and a bf16 elementwise rate).
PROFILE_METHOD = "3"


def measure_local_cpu(budget_s: float = 0.6, size: int = 256) -> GPUSpec:
    """Profile one single-threaded process on this machine.

    peak_flops: best float32 matmul rate over repeated `size`^3 products (1 thread),
    memory_bandwidth: best large-tensor copy rate, both measured; memory: physical RAM
    divided by the cores that share it. Loopback links are nominal gloo figures.
    """
    from partita.errors import signals_held

    with signals_held():  # a Ctrl-C meanwhile waits for torch's import (see there)
        import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what every test rank uses; restored below
    try:
        flops = matmul_rate(size, budget_s)
        # The same size as fp32: at 128^3 bf16 products run at 0.6 of their 256^3 rate
        # on a CPU with bf16 units (Zen 4: 124 against 203 GFLOP/s, where a training
        # step's GEMMs reach 185), so a smaller product would measure its overheads.
        bf16 = training_matmul_rate(size, budget_s / 4)
        n = 1 << 22  # 16 MiB of float32: beyond the caches
        src, dst = torch.randn(n), torch.empty(n)
        copy_rate = best_rate(lambda a, b: b.copy_(a), src, dst, 2.0 * 4 * n, budget_s / 2)
        # A bf16 add of 1M elements (read two, write one): what eager bf16 kernels move.
        halves = [torch.randn(1 << 20).bfloat16() for _ in range(3)]
        bf16_rate = best_rate(lambda a, b: torch.add(a, b, out=halves[2]), *halves[:2],
                              3.0 * 2 * (1 << 20), budget_s / 4)
        op_s = eager_op_cost(budget_s / 2)
    finally:
        torch.set_num_threads(threads)
    cores = os.cpu_count() or 1
    ram = _physical_memory()
    return GPUSpec(
        name="cpu",
        peak_flops=flops,
        memory_bytes=ram / cores,
        memory_bandwidth=copy_rate,
        # gloo over loopback TCP: a few GB/s and tens of microseconds per message,
        # nominal figures for a shared machine rather than measurements.
        intra_node_bandwidth=2 * GB,
        inter_node_bandwidth=1 * GB,
        intra_node_latency=50e-6,
        inter_node_latency=100e-6,
        host_link_bandwidth=copy_rate,  # "offload" to host memory is a memory copy
        host_memory_per_node=ram,
        gpus_per_node=cores,
        runtime_reserved_bytes=0.0,  # no device context: counted in process RSS instead
        eager_op_s=op_s,
        bf16_flops=bf16,
        bf16_memory_bandwidth=bf16_rate,
        source=f"measured on this machine: {size}^3 fp32 and bf16 matmuls on 1 "
               "thread, copy bandwidth, a bf16 add, eager steps of a tiny model, "
               "/proc/meminfo",
    )


def eager_op_cost(budget_s: float = 0.3) -> float:
    """Seconds per eager operation: forward, loss and backward of partita's model at dim
    16 and 8 tokens, where nearly all the time is the operations' own cost, divided by
    the operations they dispatch; the median pass within `budget_s`. (The optimizer is
    left out: its operations are few and counted apart.) The caller sets the thread count.

    The operations are the planner's own count of that model (`planner.eager_ops`,
    which tests/unit/test_eager_ops.py checks against a TorchDispatchMode; 481, where a
    live count of this pass with torch's loss reads 474): counting them here would
    import torch._dynamo, which a dispatch mode pulls in, 3.4 s of every `partita plan
    --gpu-type cpu` on this project's machine."""
    import time

    import torch

    from partita.layout import Layout
    from partita.models.model_config import ModelConfig
    from partita.models.transformer import Transformer
    from partita.planner.eager_ops import block_ops, edge_ops
    from partita.planner.model_shape import PlanModel

    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                      max_seq_len=8)
    with torch.random.fork_rng():  # leave the caller's random stream alone
        torch.manual_seed(0)
        model = Transformer(cfg)
        tokens = torch.randint(cfg.vocab_size, (1, 9))
    fwd, bwd = block_ops(PlanModel("probe", cfg), Layout())
    ops = cfg.n_layers * (fwd + bwd) + sum(edge_ops(PlanModel("probe", cfg)))

    def step() -> None:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: first allocations
    times = []
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] / ops


def local_bf16_units(profile: GPUSpec) -> str:
    """This CPU's bf16 units (`models.attention_kernel.BF16_UNITS`) from the feature flags
    in /proc/cpuinfo, the ones torch's own checks read; where there is no such file,
    from `profile`: bf16 products at least as fast as fp32 ones mean AVX-512 BF16."""
    from partita.models.attention_kernel import bf16_units_from_flags

    flags = cpuinfo_value(("flags", "Features"))
    if flags is not None:
        return bf16_units_from_flags(set(flags.split()))
    return "avx512" if profile.bf16_flops >= profile.peak_flops else "none"


def _physical_memory() -> float:
    total = meminfo_bytes("MemTotal")
    return total if total is not None else float(os.sysconf("SC_PAGE_SIZE")
                                                 * os.sysconf("SC_PHYS_PAGES"))


def profile_cache_path() -> Path:
    """Where `cached_local_cpu` keeps this machine's profile: $PARTITA_CACHE_DIR, else
    partita's folder in the user's cache (`machine_cache.default_cache_dir`)."""
    return kept_file("cpu-profile.json")


def cached_local_cpu(path: Path | None = None, remeasure: bool = False,
                     max_age_s: float = CACHE_MAX_AGE_S,
                     measure: Callable[[], GPUSpec] = measure_local_cpu,
                     now: Callable[[], float] = time.time) -> tuple[GPUSpec, str]:
    """This machine's profile and a sentence on where it came from: the one kept at
    `path` when it was measured here within `max_age_s`, else a new measurement, which
    replaces it. A file that cannot be read or written only costs the measurement."""
    path = path or profile_cache_path()
    key = machine_key(PROFILE_METHOD)
    if not remeasure:
        kept = _read_profile(path, key, max_age_s, now)
        if kept is not None:
            spec, measured_at = kept
            return spec, (f"cpu profile measured {_utc(measured_at)}, kept in {path} "
                          "(--remeasure measures again)")
    spec, measured_at = measure(), now()
    where = write_kept(path, key, measured_at, dataclasses.asdict(spec), field="profile")
    return spec, (f"cpu profile measured now ({_utc(measured_at)})"
                  + (f", kept in {path} for {max_age_s / 3600:g} h" if where else ""))


def _read_profile(path: Path, key: dict[str, str], max_age_s: float,
                  now: Callable[[], float]) -> tuple[GPUSpec, float] | None:
    kept = read_kept(path, key, max_age_s, now, field="profile")
    if kept is None:
        return None
    fields = {f.name for f in dataclasses.fields(GPUSpec)}
    try:
        return GPUSpec(**{k: v for k, v in kept[0].items() if k in fields}), kept[1]
    except (TypeError, AttributeError):
        return None  # from an older layout: measure again


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))
