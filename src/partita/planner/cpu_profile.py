"""A hardware profile of this machine's CPU, measured by a short micro-benchmark.

Our tests and `partita bench` run one process per core with one thread each, talking
over gloo on loopback; this profile describes one such process as a "device", so the
planner can predict what those runs measure. The matmul and copy loops each stop
after a fixed time budget (well under two seconds together).
"""

from __future__ import annotations

import os

from partita.device_specs import GB, GPUSpec, best_rate, matmul_rate


def measure_local_cpu(budget_s: float = 0.6, size: int = 256) -> GPUSpec:
    """Profile one single-threaded process on this machine.

    peak_flops: best float32 matmul rate over repeated `size`^3 products (1 thread),
    memory_bandwidth: best large-tensor copy rate, both measured; memory: physical RAM
    divided by the cores that share it. Loopback links are nominal gloo figures.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what every test rank uses; restored below
    try:
        flops = matmul_rate(size, budget_s)
        n = 1 << 22  # 16 MiB of float32: beyond the caches
        src, dst = torch.randn(n), torch.empty(n)
        copy_rate = best_rate(lambda a, b: b.copy_(a), src, dst, 2.0 * 4 * n, budget_s / 2)
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
        source=f"measured on this machine: {size}^3 fp32 matmul on 1 thread, "
               f"copy bandwidth, /proc/meminfo",
    )


def _physical_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
