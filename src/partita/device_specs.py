"""What each kind of device can do: the GPU datasheet table and this CPU's measured rate.

Both the runtime (`partita.metrics` divides by a device's peak FLOP/s for MFU) and the
planner (`partita.planner.hardware` builds clusters and user profiles on these entries)
read these figures, so they live in this small module that imports nothing of partita:
neither side has to import the other, and the table exists once.

Figures are per GPU and come from vendor datasheets (named next to each entry).
Bandwidths are stored *per direction*: a ring collective moves bytes one way per
link, so the bidirectional NVLink figures NVIDIA quotes are halved. What NCCL really
achieves on those links is a separate, configurable planner assumption
(`Assumptions.intra_node_efficiency` / `inter_node_efficiency`), not baked in here.

Memory capacity is the datasheet figure in 10^9 bytes. Devices expose slightly more
(an "80 GB" H100 reports about 85.5e9 bytes), and that slack acts as a safety margin.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (no structured sparsity); a CPU's: fp32
    memory_bytes: float  # device memory capacity
    memory_bandwidth: float  # device memory, bytes/s
    intra_node_bandwidth: float  # NVLink (or equivalent) per GPU, per direction, bytes/s
    inter_node_bandwidth: float  # network per GPU, per direction, bytes/s
    intra_node_latency: float = 5e-6  # s per collective step (typical NCCL, not datasheet)
    inter_node_latency: float = 15e-6  # s per collective step (typical NCCL, not datasheet)
    host_link_bandwidth: float = 25e9  # GPU <-> CPU memory (PCIe), per direction, bytes/s
    host_memory_per_node: float = 1000 * GB  # CPU memory of one node, for offload
    gpus_per_node: int = 8
    # Device memory outside the framework's allocator: CUDA context, cuBLAS and NCCL
    # workspaces (about 0.5-1 GB on recent NVIDIA drivers; not a datasheet figure).
    runtime_reserved_bytes: float = 1.0 * GB
    # Host time of one eager PyTorch operation (dispatch, autograd bookkeeping,
    # allocation). A CPU pays it in line with the work; a GPU's launches run ahead of
    # its kernels, which hides it, so the catalog leaves it 0. Measured for `cpu`.
    eager_op_s: float = 0.0
    # The 16-bit matmul rate where it is not `peak_flops`: a CPU profile's peak is its
    # float32 rate, and a CPU without bf16 units runs bf16 far slower. 0: peak_flops.
    bf16_flops: float = 0.0
    # The bytes per second a 16-bit elementwise kernel moves where it is not
    # `memory_bandwidth`: a CPU's eager bf16 kernels convert every element to fp32 and
    # back (Zen 4, one thread: an add at 31 GB/s, fp32's at 72-83, a copy at 90). 0: the
    # same as memory_bandwidth.
    bf16_memory_bandwidth: float = 0.0
    # The float32 matmul rate where it is not `peak_flops` (a GPU's peak is bf16): CUDA
    # cores, not TF32 tensor cores, which torch uses for float32 matmuls only when
    # torch.backends.cuda.matmul.allow_tf32 (or set_float32_matmul_precision) says so.
    # 0: peak_flops (a CPU profile's peak is already its float32 rate).
    fp32_flops: float = 0.0
    source: str = ""

    def for_dtype_bytes(self, elem_bytes: int) -> GPUSpec:
        """This device as a run in `elem_bytes`-wide parameters sees it: its 16-bit
        matmul rate as the peak and its 16-bit elementwise rate as the bandwidth, where
        they are given separately (`bf16_flops`, `bf16_memory_bandwidth`); in 4-byte
        parameters its float32 matmul rate (`fp32_flops`), where given."""
        if elem_bytes == 4 and self.fp32_flops > 0:
            return replace(self, peak_flops=self.fp32_flops)
        if elem_bytes != 2:
            return self
        given = {"peak_flops": self.bf16_flops, "memory_bandwidth": self.bf16_memory_bandwidth}
        return replace(self, **{k: v for k, v in given.items() if v > 0})


# Every figure below is from the vendor datasheet named in `source`. Network: one
# ConnectX NIC per GPU as in the DGX reference designs (HDR 200 Gb/s on A100, NDR
# 400 Gb/s on Hopper and Blackwell); PCIe: Gen4 x16 on A100, Gen5 x16 from Hopper on.
# float32 (CUDA cores, no TF32): A100 19.5 TFLOPS, H100/H200 SXM 67 (their datasheets);
# B200 75, NVIDIA's HGX B200 specification (600 TFLOPS FP32 for 8 GPUs).
GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4): 312 TFLOPS bf16 dense, 40 GB HBM2
    # at 1,555 GB/s, NVLink 600 GB/s bidirectional; DGX A100 datasheet: 8x HDR 200 Gb/s.
    "A100-40GB": GPUSpec("A100-40GB", 312e12, 40 * GB, 1555e9, 300e9, 25e9,
                         host_link_bandwidth=32e9, host_memory_per_node=1000 * GB,
                         fp32_flops=19.5e12,
                         source="NVIDIA A100 datasheet; DGX A100 datasheet"),
    # Same datasheet, 80 GB HBM2e at 2,039 GB/s; DGX A100 (640 GB) has 2 TB of host RAM.
    "A100-80GB": GPUSpec("A100-80GB", 312e12, 80 * GB, 2039e9, 300e9, 25e9,
                         host_link_bandwidth=32e9, host_memory_per_node=2000 * GB,
                         fp32_flops=19.5e12,
                         source="NVIDIA A100 datasheet; DGX A100 datasheet"),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS bf16 dense (1,979 with
    # sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional; DGX H100
    # datasheet: 8x ConnectX-7 400 Gb/s, 2 TB host memory.
    "H100": GPUSpec("H100", 989e12, 80 * GB, 3350e9, 450e9, 50e9,
                    host_link_bandwidth=64e9, host_memory_per_node=2000 * GB, fp32_flops=67e12,
                    source="NVIDIA H100 datasheet; DGX H100 datasheet"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS bf16 dense, 141 GB HBM3e
    # at 4.8 TB/s, NVLink 900 GB/s; DGX H200 datasheet: 8x 400 Gb/s, 2 TB host memory.
    "H200": GPUSpec("H200", 989e12, 141 * GB, 4800e9, 450e9, 50e9,
                    host_link_bandwidth=64e9, host_memory_per_node=2000 * GB, fp32_flops=67e12,
                    source="NVIDIA H200 datasheet; DGX H200 datasheet"),
    # NVIDIA DGX B200 datasheet: 8 GPUs, 72 PFLOPS FP8 training with sparsity
    # (=> 2.25 PFLOPS bf16 dense per GPU), 1,440 GB HBM3e (180 GB each) at 64 TB/s
    # (8 TB/s each), NVLink 5 at 1.8 TB/s bidirectional, 8x 400 Gb/s, 4 TB host memory.
    "B200": GPUSpec("B200", 2250e12, 180 * GB, 8000e9, 900e9, 50e9,
                    host_link_bandwidth=64e9, host_memory_per_node=4000 * GB, fp32_flops=75e12,
                    source="NVIDIA DGX B200 datasheet; NVIDIA Blackwell datasheet"),
}
ALIASES = {"H100-SXM": "H100", "H100-80GB": "H100", "H200-SXM": "H200", "A100": "A100-80GB"}


def datasheet_peak_flops(device_name: str) -> float | None:
    """Dense bf16 FLOP/s of the catalog GPU whose family appears in `device_name` (as
    CUDA reports it, e.g. "NVIDIA A100-SXM4-80GB"); None for a GPU not in the table."""
    for key, spec in GPUS.items():
        if key.split("-")[0] in device_name:  # "A100-80GB" matches "NVIDIA A100-SXM4-80GB"
            return spec.peak_flops
    return None


def matmul_rate(size: int = 256, budget_s: float = 0.3, dtype_name: str = "float32") -> float:
    """Best FLOP/s of `size`^3 matmuls in `dtype_name` on the current thread setting."""
    import torch

    a, b = _operands(size, getattr(torch, dtype_name))
    return best_rate(lambda x, y: torch.mm(x, y), a, b, 2.0 * size**3, budget_s)


def _operands(size: int, dtype):
    """Two random `size` x `size` matrices drawn from a generator of their own: a
    measurement made while a run starts must not move the global random stream its
    dropout masks come from (a resumed run would no longer match an unbroken one)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))


def training_matmul_rate(size: int, budget_s: float, dtype_name: str = "bfloat16") -> float:
    """FLOP/s of `size`^3 products in `dtype_name` in the three operand layouts of a
    linear layer's training step, equal FLOPs each: forward x @ W^T, input gradient
    g @ W, weight gradient g^T @ x. On a CPU without 16-bit units their rates differ up
    to tenfold (here ~6, ~2 and ~20 GFLOP/s in bf16), so the step's rate is their
    time-weighted mean."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = _operands(size, dtype)
    work = 2.0 * size**3
    layouts = (lambda x, y: torch.mm(x, y.t()), lambda x, y: torch.mm(x, y),
               lambda x, y: torch.mm(x.t(), y))
    rates = [best_rate(op, a, b, work, budget_s / 3) for op in layouts]
    return len(rates) / sum(1 / r for r in rates)


def slow_cpu_matmul_warning(dtype_name: str, budget_s: float = 0.1,
                            slower_than: float = 3.0) -> str | None:
    """A warning when `dtype_name` (bfloat16, float16) matmuls on this CPU run more than
    `slower_than` times slower than float32, as they do on CPUs without 16-bit matrix
    units (AVX512-BF16, AMX): there mixed precision slows training down instead of
    speeding it up. None when they keep up. Measured on the caller's thread setting."""
    size = 64  # the slow path runs at a few GFLOP/s: small products keep this short
    fp32 = training_matmul_rate(size, budget_s / 2, "float32")
    half = training_matmul_rate(size, budget_s / 2, dtype_name)
    if fp32 < slower_than * half:
        return None
    return (f"partita: warning: {dtype_name} matmuls run at {half / 1e9:.1f} GFLOP/s on this CPU, "
            f"{fp32 / half:.0f}x slower than float32 ({fp32 / 1e9:.0f} GFLOP/s): it has no "
            "16-bit matrix units (AVX512-BF16 or AMX), so mixed precision makes this run "
            "slower, not faster. Train in float32 here (train.dtype=float32, "
            "precision.param_dtype empty); 16-bit training pays off on GPUs and on CPUs "
            "with those units.")


def best_rate(op: Callable, a, b, work: float, budget_s: float) -> float:
    """`work` divided by the fastest of repeated `op(a, b)` calls within `budget_s`."""
    op(a, b)  # warm-up: first call allocates and picks kernels
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        op(a, b)
        best = min(best, time.perf_counter() - start)
    return work / best
