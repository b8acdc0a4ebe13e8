"""Which parameters move together: blocks for stage 3, size-capped buckets for 0-2.

ZeRO works on any nn.Module once told which submodules are its blocks: by a list of
module names, by class, or by an fnmatch pattern over module names. Models with a
`plan()` (partita's own) name their blocks themselves.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.nn as nn

from partita.errors import PartitaError
from partita.sharding import has_shard_info, pipeline_stages

if TYPE_CHECKING:
    from partita.mesh import Mesh

EDGE_BUCKET_BYTES = 1 << 20
LAST_BUCKET_BYTES = 1 << 20

BlockSpec = None | list[str] | tuple[str, ...] | type | str
NamedParams = list[tuple[str, nn.Parameter]]


def resolve_blocks(module: nn.Module, blocks: BlockSpec) -> list[str]:
    """Names of the block submodules, in registration (= forward) order."""
    names = [n for n, _ in module.named_modules() if n]
    if blocks is None:
        plan = getattr(module, "plan", None)
        return list(plan().block_names(module)) if callable(plan) else []
    if isinstance(blocks, (list, tuple)):
        missing = [b for b in blocks if b not in names]
        if missing:
            from partita.errors import did_you_mean

            raise PartitaError(
                f"block '{missing[0]}' is not a submodule of {type(module).__name__}."
                f"{did_you_mean(missing[0], names)} Give blocks as module names from "
                "model.named_modules(), a block class, or a pattern such as 'layers.*'."
            )
        found = list(blocks)
    elif isinstance(blocks, type):
        found = [n for n, m in module.named_modules() if n and isinstance(m, blocks)]
    elif isinstance(blocks, str):
        found = [n for n in names if fnmatch.fnmatchcase(n, blocks)]
    else:
        raise PartitaError(
            f"blocks={blocks!r} is not understood; pass a list of module names, a block "
            "class, or an fnmatch pattern over module names such as 'layers.*'."
        )
    # Keep the outermost matches only: a block inside a block is part of it.
    outer = [n for n in found if not any(n.startswith(o + ".") for o in found if o != n)]
    return outer


def partition(module: nn.Module, block_names: list[str]) -> tuple[NamedParams,
                                                                  list[NamedParams]]:
    """(root parameters, parameters of each block) -- trainable ones, each once."""
    seen: set[int] = set()
    per_block: list[NamedParams] = [[] for _ in block_names]
    root: NamedParams = []
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        for i, b in enumerate(block_names):
            if name.startswith(b + "."):
                per_block[i].append((name, p))
                break
        else:
            root.append((name, p))
    return root, per_block


def gather_units(per_block: list[NamedParams], unit_bytes: int,
                 itemsize: int) -> list[list[int]]:
    """Consecutive blocks merged into stage-3 gather units of at most `unit_bytes`
    (a block larger than that is a unit by itself); indices into `per_block`, which
    only names blocks that hold trainable parameters."""
    units: list[list[int]] = []
    size = 0
    for i, params in enumerate(per_block):
        nbytes = sum(p.numel() for _, p in params) * itemsize
        if not units or size + nbytes > unit_bytes:
            units.append([])
            size = 0
        units[-1].append(i)
        size += nbytes
    return units


def buckets_by_size(module: nn.Module, bucket_bytes: int, itemsize: int,
                    key: Callable[[str], object] | None = None,
                    overlap_caps: bool = True) -> list[NamedParams]:
    """Trainable parameters in reverse registration order (the order backward usually
    produces their gradients), cut greedily into buckets of about `bucket_bytes`.

    With `overlap_caps` the first and the last bucket are capped (EDGE_,
    LAST_BUCKET_BYTES): the first so that communication starts early (as DDP does), the
    last because its collective can only start when backward ends, so its size is the
    exposed tail of the step. Both pay off only where a collective runs beside the
    backward instead of taking turns with it on the same cores (see the engine). With `key`,
    a bucket never holds parameters of two keys (a pipeline rank's chunks: each chunk's
    buckets can then be reduced as soon as that chunk's last backward is done)."""
    seen: set[int] = set()
    params = []
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append((name, p))
    key = key or (lambda name: None)
    edge = min(bucket_bytes, EDGE_BUCKET_BYTES) if overlap_caps else bucket_bytes
    last_cap = min(bucket_bytes, LAST_BUCKET_BYTES) if overlap_caps else 0
    last: NamedParams = []
    size = 0
    while len(params) > 1 and size + params[0][1].numel() * itemsize <= last_cap and \
            (not last or key(params[0][0]) == key(last[0][0])):
        size += params[0][1].numel() * itemsize
        last.append(params.pop(0))
    out: list[NamedParams] = [[]]
    size = 0
    for name, p in reversed(params):
        cap = edge if len(out) == 1 else bucket_bytes
        if out[-1] and (size + p.numel() * itemsize > cap or key(name) != key(out[-1][0][0])):
            out.append([])
            size = 0
        out[-1].append((name, p))
        size += p.numel() * itemsize
    out.append(list(reversed(last)))
    return [b for b in out if b]


def require_blocks(module: nn.Module, block_names: list[str]) -> None:
    if not block_names:
        raise PartitaError(
            f"ZeRO stage 3 found no blocks in {type(module).__name__}: it gathers parameters "
            "block by block, so it must know the blocks. Pass DataParallel(..., blocks=...) "
            "as a list of module names, the block class (e.g. blocks=MyDecoderLayer), or a "
            "pattern such as 'model.layers.*'; or use zero stage 2, which needs no blocks."
        )


def require_model_parallel(module: nn.Module, mesh: Mesh) -> None:
    """Refuse a mesh with tensor-parallel ranks (tp > 1) for a module that tensor
    parallelism has not split, or with pipeline ranks (pp > 1) for one no pipeline cut:
    the engine reduces gradients over the data-parallel group only, so peers holding whole
    copies would each train on their own and drift apart. Tensor parallelism tags every
    parameter it leaves (partita.sharding.ShardInfo), the pipeline cut the model."""
    tp = mesh.size("tensor")
    if tp > 1 and not any(has_shard_info(p) for p in module.parameters()):
        raise PartitaError(
            f"the mesh has tp={tp} but {type(module).__name__} carries no tensor-parallel "
            "layers, so its copies on the tp ranks would never exchange gradients and "
            "would train apart. Build the mesh with tp=1 (all ranks data-parallel), or "
            "split the model first: partita.parallelize.parallelize(model, plan, cfg, "
            "mesh, device) applies its plan's tensor parallelism and wraps it.")
    pp = mesh.size("pipeline")
    if pp > 1 and pipeline_stages(module) is None:
        raise PartitaError(
            f"the mesh has pp={pp} but {type(module).__name__} is whole: no pipeline cut "
            "it into stages, so each pipeline rank would train its own copy apart from the "
            "others. Build the mesh with pp=1, or let partita.parallelize.parallelize(model, "
            "plan, cfg, mesh, device) cut the model and run it with its pipeline runner.")
