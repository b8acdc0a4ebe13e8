"""Hardware the planner models: a GPU type looked up by name or read from a user
profile, and the cluster it sits in.

The datasheet table itself (`GPUSpec`, `GPUS`) lives in `partita.device_specs`, which the
runtime reads too; `cpu` is this machine measured by `partita.planner.cpu_profile`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from partita.config_ranges import AT_LEAST_0, AT_LEAST_1, POSITIVE
from partita.config_values import read_user_file
from partita.device_specs import ALIASES, GB, GPUS, GPUSpec
from partita.errors import PartitaError, did_you_mean
from partita.planner.cpu_profile import measure_local_cpu

__all__ = ["GB", "GPUS", "GPUProfile", "GPUSpec", "Cluster", "get_gpu", "gpu_family",
           "known_gpu_names", "load_gpu_profiles"]

LOCAL_CPU = "cpu"
REQUIRED = ("peak_flops", "memory_bytes", "memory_bandwidth", "intra_node_bandwidth",
            "inter_node_bandwidth")


@dataclass(frozen=True)
class GPUProfile(GPUSpec):
    """A --hardware profile. One that starts from a catalog entry (`base = "H100"`, or
    a profile that does) runs that family's kernels, so the family's figures that are
    not a GPUSpec field (the GEMM fraction, compute.gemm_fraction) follow `family`, the
    catalog entry's name, never the profile's own name. Without a base, `family` is ""
    and those figures are the documented defaults."""

    family: str = ""


def gpu_family(gpu: GPUSpec) -> str:
    """The catalog GPU whose kernels `gpu` runs: a catalog entry's own name, a
    --hardware profile's base's ("" for a profile without one)."""
    return gpu.family if isinstance(gpu, GPUProfile) else gpu.name


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
        return measure_local_cpu()
    known = known_gpu_names(extra)
    raise PartitaError(
        f"unknown GPU type '{name}'.{did_you_mean(name, known)} Known GPU types: "
        f"{', '.join(known)}; or describe yours in a TOML file given with --hardware "
        f"FILE: a [gpu.NAME] table with {', '.join(REQUIRED)} (FLOP/s and bytes/s, "
        "e.g. peak_flops = 989e12), or base = \"H100\" and the fields that differ."
    )


def load_gpu_profiles(path: str | Path) -> dict[str, GPUSpec]:
    """User hardware profiles from TOML: one `[gpu.NAME]` table of GPUSpec fields each.

    A table may set `base = "H100"` to start from a catalog entry and override a few
    fields, e.g. `[gpu.h100-slow-net]  base = "H100"  inter_node_bandwidth = 25e9`.
    """
    path = Path(path)
    give = "give a TOML file of [gpu.NAME] tables"
    text = read_user_file(path, "hardware file", give, missing=give)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PartitaError(f"hardware file '{path}' is not valid TOML: {exc}.") from None
    tables = data.get("gpu")
    if not isinstance(tables, dict) or not tables:
        raise PartitaError(
            f"hardware file '{path}' has no [gpu.NAME] table; write one per GPU type with "
            f"the fields {', '.join(f.name for f in fields(GPUSpec) if f.name != 'name')}."
        )
    known = {f.name for f in fields(GPUSpec)} - {"name"}  # the table's own name
    out: dict[str, GPUSpec] = {}
    for name, table in tables.items():
        where = f"hardware file '{path}', [gpu.{name}]"
        if not isinstance(table, dict):
            raise PartitaError(f"{where}: '{name}' must be a table of GPUSpec fields, e.g. "
                               f'[gpu.{name}] with base = "H100" and memory_bytes = 40e9.')
        table = dict(table)
        base_name = table.pop("base", None)
        if "name" in table:
            raise PartitaError(f"{where}: remove name = {table['name']!r}; a profile is "
                               f"named by its table, here '{name}' ([gpu.NAME]).")
        unknown = sorted(set(table) - known)
        if unknown:
            raise PartitaError(
                f"{where}: unknown field '{unknown[0]}'."
                f"{did_you_mean(unknown[0], known)} Fields: {', '.join(sorted(known))}."
            )
        for key, value in table.items():
            _check_field(where, key, value)
        table.setdefault("source", f"user profile {path}")
        if base_name is not None:
            if not isinstance(base_name, str):
                raise PartitaError(f"{where}: base = {base_name!r} is not a GPU name; give "
                                   f"one in quotes, e.g. base = \"H100\".")
            if base_name.lower() == name.lower():
                raise PartitaError(f"{where}: base = \"{base_name}\" names this table "
                                   "itself; give a catalog GPU ("
                                   f"{', '.join(GPUS)}) or a table above this one.")
            try:
                base = get_gpu(base_name, out)
            except PartitaError:  # name the file and table the bad base is in
                raise PartitaError(
                    f"{where}: base = \"{base_name}\" is no catalog GPU and no table "
                    f"above this one.{did_you_mean(base_name, [*GPUS, *out])} Catalog "
                    f"GPUs: {', '.join(GPUS)}"
                    + (f"; tables above: {', '.join(out)}" if out else "") + ".") from None
            out[name] = GPUProfile(**{**vars(replace(base, name=name, **table)),
                                      "family": gpu_family(base)})
            continue
        missing = [f for f in REQUIRED if f not in table]
        if missing:
            raise PartitaError(
                f"{where}: missing {', '.join(missing)} "
                "(or set base = \"H100\" to start from a catalog entry)."
            )
        # No family: its name, however like a catalog GPU's, says nothing of its kernels.
        out[name] = GPUProfile(name=name, **table)
    return out


# What each GPUSpec figure may be: rates, bandwidths and sizes divide or bound
# everything, so they are > 0; latencies and host costs may be 0 (not modelled);
# bf16_flops and fp32_flops 0 mean "peak_flops".
_POSITIVE = (*REQUIRED, "host_link_bandwidth", "host_memory_per_node")
_AT_LEAST_0 = ("intra_node_latency", "inter_node_latency", "runtime_reserved_bytes",
               "eager_op_s", "bf16_flops", "fp32_flops")


def _check_field(where: str, key: str, value: object) -> None:
    """Refuse a profile value of the wrong type or range, naming the field."""
    if key == "source":
        if not isinstance(value, str):
            raise PartitaError(f"{where}: source = {value!r} must be text (where the "
                               "figures come from), in quotes.")
        return
    if key == "gpus_per_node":
        if not (AT_LEAST_1.ok(value) and isinstance(value, int)):
            raise PartitaError(f"{where}: gpus_per_node = {value!r} must be a whole number "
                               ">= 1, e.g. gpus_per_node = 8.")
        return
    rule = POSITIVE if key in _POSITIVE else AT_LEAST_0
    if not rule.ok(value):  # a finite number in range, never a bool
        unit = ("FLOP/s" if key.endswith("flops") else "bytes/s" if key.endswith("bandwidth")
                else "s" if key.endswith(("latency", "_s")) else "bytes")
        example = GPUS["H100"]
        raise PartitaError(f"{where}: {key} = {value!r} is not a valid figure; give a "
                           f"finite number {rule.text} in {unit}, e.g. {key} = "
                           f"{getattr(example, key):g} (the {example.name}'s).")


@dataclass(frozen=True)
class Cluster:
    """`num_gpus` GPUs of one type, `gpus_per_node` to a node."""

    gpu: GPUSpec
    num_gpus: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise PartitaError("the number of GPUs and GPUs per node must be positive.")

    @property
    def ranks_per_node(self) -> int:
        """GPUs in use on one node: a cluster smaller than a node uses only its own."""
        return min(self.num_gpus, self.gpus_per_node)

    def within_node(self, span: int) -> bool:
        """Whether every group of `span` consecutive ranks (ranks 0..span-1, span..2span-1,
        ...) lies in one node: the whole cluster does, or `span` divides the node size.
        Otherwise some group straddles a node boundary (6 per node, span 4: ranks 4-7)."""
        return self.num_gpus <= self.gpus_per_node or self.gpus_per_node % span == 0

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group whose members lie within `span` consecutive ranks.

        Groups that lie in a node use NVLink; where any group crosses a node boundary
        (`within_node`), the collective is paced by each GPU's own network port (one NIC
        per GPU).
        """
        if self.within_node(span):
            return self.gpu.intra_node_bandwidth, self.gpu.intra_node_latency
        return self.gpu.inter_node_bandwidth, self.gpu.inter_node_latency
