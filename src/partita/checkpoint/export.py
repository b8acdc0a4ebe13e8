"""Whole tensors out of a sharded checkpoint, in one process, one tensor at a time.

`full_tensors(folder)` yields each parameter's full value assembled from every rank's
pieces (the master copy where the run kept one: the most precise value it had), which
`partita checkpoint export` writes as one safetensors file of unsharded weights, the
same names and shapes as the single-device model's. Memory stays at one tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from partita.checkpoint.files import DTYPES_BY_NAME
from partita.checkpoint.manifest import read_manifest
from partita.checkpoint.reader import SavedPieces
from partita.checkpoint.regions import Region
from partita.checkpoint.state import MASTER, WEIGHTS


def full_tensors(folder: str | Path, state: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(global name, full tensor) for every parameter in the checkpoint. `state`: one
    of partita.checkpoint.state.STATES; "" = the master copy if saved, else the
    parameters."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    sources = SavedPieces(folder, manifest)
    try:
        for name, shape in sources.shapes.items():
            wanted = state or (MASTER if sources.has(name, MASTER) else WEIGHTS)
            first = sources.pieces[name][0]
            record = sources.records[first["file"]]
            dtype = next(t.dtype for t in record.tensors if t.key == first["keys"][wanted])
            out = torch.empty(math.prod(shape), dtype=DTYPES_BY_NAME[dtype])
            sources.fill(out, name, wanted, Region(tuple(shape), None, 0, 0, 0, out.numel()))
            yield name, out.view(shape)
    finally:
        sources.close()
