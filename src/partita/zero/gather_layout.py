"""Stage 3's flat buffers: the gather units of blocks, and the root group.

    root, units = stage3_buffers(module, block_names, mesh, comm, unit_bytes, dtype, device)

`units` are the gather units in forward order, each (its block modules, their flat
buffer), with units of their own for parameters reduced over another group (an MoE's
experts) right after their block's; `root` holds every trained parameter outside the
blocks (embeddings, final norm, head), None when there is none.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from partita.comm import GroupComm
from partita.mesh import Mesh
from partita.zero.families import split_families, with_family_units
from partita.zero.flat import FlatBuffer
from partita.zero.units import gather_units, partition

Unit = tuple[tuple[nn.Module, ...], FlatBuffer]


def stage3_buffers(module: nn.Module, names: list[str], mesh: Mesh, comm: GroupComm,
                   unit_bytes: int, dtype: torch.dtype, device: torch.device
                   ) -> tuple[FlatBuffer | None, list[Unit]]:
    n, index = comm.size, comm.index
    root_params, per_block = partition(module, names)
    per_block, apart = split_families(per_block)
    trained = [(nm, ps) for nm, ps in zip(names, per_block) if ps]
    units = gather_units([ps for _, ps in trained], unit_bytes, dtype.itemsize)
    block_bufs = [(tuple(module.get_submodule(trained[i][0]) for i in unit),
                   FlatBuffer([p for i in unit for p in trained[i][1]], n, index, dtype, device))
                  for unit in units]
    block_bufs = with_family_units(module, mesh, block_bufs, apart, dtype, device)
    root = FlatBuffer(root_params, n, index, dtype, device) if root_params else None
    return root, block_bufs
