"""Hardware descriptions: one accelerator type and the cluster it sits in.

Figures are per GPU and come from vendor datasheets (named next to each entry).
Bandwidths are stored *per direction*: a ring collective moves bytes one way per
link, so the bidirectional NVLink figures NVIDIA quotes are halved. What NCCL really
achieves on those links is a separate, configurable assumption
(`Assumptions.intra_node_efficiency` / `inter_node_efficiency`), not baked in here.

Memory capacity is the datasheet figure in 10^9 bytes. Devices expose slightly more
(an "80 GB" H100 reports about 85.5e9 bytes), and that slack acts as a safety margin.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from partita.errors import PartitaError, did_you_mean

GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (no structured sparsity)
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
    source: str = ""


# Every figure below is from the vendor datasheet named in `source`. Network: one
# ConnectX NIC per GPU as in the DGX reference designs (HDR 200 Gb/s on A100, NDR
# 400 Gb/s on Hopper and Blackwell); PCIe: Gen4 x16 on A100, Gen5 x16 from Hopper on.
GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4): 312 TFLOPS bf16 dense, 40 GB HBM2
    # at 1,555 GB/s, NVLink 600 GB/s bidirectional; DGX A100 datasheet: 8x HDR 200 Gb/s.
    "A100-40GB": GPUSpec("A100-40GB", 312e12, 40 * GB, 1555e9, 300e9, 25e9,
                         host_link_bandwidth=32e9, host_memory_per_node=1000 * GB,
                         source="NVIDIA A100 datasheet; DGX A100 datasheet"),
    # Same datasheet, 80 GB HBM2e at 2,039 GB/s; DGX A100 (640 GB) has 2 TB of host RAM.
    "A100-80GB": GPUSpec("A100-80GB", 312e12, 80 * GB, 2039e9, 300e9, 25e9,
                         host_link_bandwidth=32e9, host_memory_per_node=2000 * GB,
                         source="NVIDIA A100 datasheet; DGX A100 datasheet"),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS bf16 dense (1,979 with
    # sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional; DGX H100
    # datasheet: 8x ConnectX-7 400 Gb/s, 2 TB host memory.
    "H100": GPUSpec("H100", 989e12, 80 * GB, 3350e9, 450e9, 50e9,
                    host_link_bandwidth=64e9, host_memory_per_node=2000 * GB,
                    source="NVIDIA H100 datasheet; DGX H100 datasheet"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS bf16 dense, 141 GB HBM3e
    # at 4.8 TB/s, NVLink 900 GB/s; DGX H200 datasheet: 8x 400 Gb/s, 2 TB host memory.
    "H200": GPUSpec("H200", 989e12, 141 * GB, 4800e9, 450e9, 50e9,
                    host_link_bandwidth=64e9, host_memory_per_node=2000 * GB,
                    source="NVIDIA H200 datasheet; DGX H200 datasheet"),
    # NVIDIA DGX B200 datasheet: 8 GPUs, 72 PFLOPS FP8 training with sparsity
    # (=> 2.25 PFLOPS bf16 dense per GPU), 1,440 GB HBM3e (180 GB each) at 64 TB/s
    # (8 TB/s each), NVLink 5 at 1.8 TB/s bidirectional, 8x 400 Gb/s, 4 TB host memory.
    "B200": GPUSpec("B200", 2250e12, 180 * GB, 8000e9, 900e9, 50e9,
                    host_link_bandwidth=64e9, host_memory_per_node=4000 * GB,
                    source="NVIDIA DGX B200 datasheet; NVIDIA Blackwell datasheet"),
}
ALIASES = {"H100-SXM": "H100", "H100-80GB": "H100", "H200-SXM": "H200", "A100": "A100-80GB"}
LOCAL_CPU = "cpu"
REQUIRED = ("peak_flops", "memory_bytes", "memory_bandwidth", "intra_node_bandwidth",
            "inter_node_bandwidth")


def known_gpu_names(extra: dict[str, GPUSpec] | None = None) -> list[str]:
    return [*GPUS, *(extra or {}), LOCAL_CPU]


def get_gpu(name: str, extra: dict[str, GPUSpec] | None = None) -> GPUSpec:
    """Catalog entry `name` (case-insensitive); `cpu` measures this machine.

    `extra` holds user profiles (see `load_gpu_profiles`), which take precedence.
    """
    table = {**GPUS, **(extra or {})}
    lookup = {k.lower(): k for k in table} | {k.lower(): v for k, v in ALIASES.items()}
    key = lookup.get(name.lower())
    if key is not None:
        return table[key]
    if name.lower() == LOCAL_CPU:
        from partita.planner.cpu_profile import measure_local_cpu

        return measure_local_cpu()
    known = known_gpu_names(extra)
    raise PartitaError(
        f"unknown GPU type '{name}'.{did_you_mean(name, known)} Known GPU types: "
        f"{', '.join(known)}; or describe yours in a TOML file (--hardware FILE)."
    )


def load_gpu_profiles(path: str | Path) -> dict[str, GPUSpec]:
    """User hardware profiles from TOML: one `[gpu.NAME]` table of GPUSpec fields each.

    A table may set `base = "H100"` to start from a catalog entry and override a few
    fields, e.g. `[gpu.h100-slow-net]  base = "H100"  inter_node_bandwidth = 25e9`.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise PartitaError(f"hardware file '{path}' does not exist.") from None
    except tomllib.TOMLDecodeError as exc:
        raise PartitaError(f"hardware file '{path}' is not valid TOML: {exc}.") from None
    tables = data.get("gpu")
    if not isinstance(tables, dict) or not tables:
        raise PartitaError(
            f"hardware file '{path}' has no [gpu.NAME] table; write one per GPU type with "
            f"the fields {', '.join(f.name for f in fields(GPUSpec) if f.name != 'name')}."
        )
    known = {f.name for f in fields(GPUSpec)}
    out: dict[str, GPUSpec] = {}
    for name, table in tables.items():
        table = dict(table)
        base_name = table.pop("base", None)
        unknown = sorted(set(table) - known)
        if unknown:
            raise PartitaError(
                f"hardware file '{path}', [gpu.{name}]: unknown field '{unknown[0]}'."
                f"{did_you_mean(unknown[0], known)} Fields: {', '.join(sorted(known))}."
            )
        table = {k: (int(v) if k == "gpus_per_node" else v) for k, v in table.items()}
        table.setdefault("source", f"user profile {path}")
        if base_name is not None:
            out[name] = replace(get_gpu(base_name, out), name=name, **table)
            continue
        missing = [f for f in REQUIRED if f not in table]
        if missing:
            raise PartitaError(
                f"hardware file '{path}', [gpu.{name}]: missing {', '.join(missing)} "
                "(or set base = \"H100\" to start from a catalog entry)."
            )
        out[name] = GPUSpec(name=name, **table)
    return out


@dataclass(frozen=True)
class Cluster:
    """`num_gpus` GPUs of one type, `gpus_per_node` to a node."""

    gpu: GPUSpec
    num_gpus: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise PartitaError("the number of GPUs and GPUs per node must be positive.")

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group whose members lie within `span` consecutive ranks.

        Groups that fit in a node use NVLink; any group that crosses a node boundary is
        limited by each GPU's own network port (one NIC per GPU).
        """
        if span <= self.gpus_per_node:
            return self.gpu.intra_node_bandwidth, self.gpu.intra_node_latency
        return self.gpu.inter_node_bandwidth, self.gpu.inter_node_latency
