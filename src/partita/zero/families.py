"""Parameter families: dense parameters are reduced and ZeRO-sharded over the dense
data-parallel group (zero_shard, dp x cp); a parameter tagged with another reduce group
(`partita.sharding.set_reduce_group`: experts, over their expert-data-parallel group)
lives in flat buffers of its own, sharded over that group, which the buffer carries as
`FlatBuffer.comm`. Both families are divided by the dense group's size: each rank's loss
is the mean over its own tokens, and experts see every rank's tokens through the
all-to-all.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from partita.mesh import Mesh
from partita.sharding import reduce_group
from partita.zero.flat import FlatBuffer
from partita.zero.units import NamedParams


def by_family(groups: list[NamedParams]) -> list[NamedParams]:
    """Each bucket cut into one per reduce group (dense first), none left empty."""
    out = []
    for g in groups:
        families: dict[str, NamedParams] = {}
        for name, p in g:
            families.setdefault(reduce_group(p), []).append((name, p))
        out += [families[k] for k in sorted(families, key=lambda k: k != "zero_shard")]
    return out


def family_buffer(mesh: Mesh, params: NamedParams, dtype: torch.dtype,
                  device: torch.device) -> FlatBuffer:
    """A flat buffer sharded over its parameters' reduce group."""
    purpose = reduce_group(params[0][1])
    comm = mesh.comm(purpose)
    buf = FlatBuffer(params, comm.size, comm.index, dtype, device)
    if purpose != "zero_shard":
        buf.comm = comm
    return buf


def split_families(per_block: list[NamedParams]
                   ) -> tuple[list[NamedParams], list[NamedParams]]:
    """(each block's dense parameters, each block's others)."""
    dense = [[(n, p) for n, p in ps if reduce_group(p) == "zero_shard"] for ps in per_block]
    other = [[(n, p) for n, p in ps if reduce_group(p) != "zero_shard"] for ps in per_block]
    return dense, other


def with_family_units(module: nn.Module, mesh: Mesh, block_bufs: list, apart: list,
                      dtype: torch.dtype, device: torch.device) -> list:
    """Stage 3: a gather unit per submodule owning non-dense parameters (an MoE's
    experts), placed after the unit holding its block; the submodule's forward gathers
    it."""
    extra: list = []
    for params in apart:
        owners: dict[str, NamedParams] = {}
        for name, p in params:
            owners.setdefault(name.rpartition(".")[0], []).append((name, p))
        extra += [((module.get_submodule(owner),), family_buffer(mesh, ps, dtype, device))
                  for owner, ps in owners.items()]
    if not extra:
        return block_bufs
    # Forward order of the modules: gather units of blocks, each followed by its own.
    order = {id(m): i for i, m in enumerate(module.modules())}
    units = block_bufs + extra
    return sorted(units, key=lambda u: order[id(u[0][0])])
