"""Loading a checkpoint into any layout of the same model.

Each rank walks the slices its own optimizer updates (`DataParallel.owned_slices`),
describes each parameter piece in them as a `Region` of the global tensor, finds which
saved pieces hold those elements (`RunIndex`), and reads exactly those byte ranges from
the memory-mapped files, checking the checksum of every block it touches. Nothing else
of the model is read on that rank. Precision may change between save and load: the
weights come from the saved master copy when there is one (else the saved parameters),
rounded to the new parameter dtype; the moments are cast to the new master dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from partita.agreement import stop_together
from partita.checkpoint.files import FileReader, record_from_json
from partita.checkpoint.manifest import (
    CheckpointFileError,
    CheckpointMismatch,
    check_model,
    read_manifest,
)
from partita.checkpoint.regions import Region, RunIndex
from partita.checkpoint.state import (
    EXP_AVG,
    EXP_AVG_SQ,
    MASTER,
    WEIGHTS,
    holds_every_stream,
    reseed_rng,
    restore_rng,
)
from partita.errors import PartitaError
from partita.layout import DEGREES


@dataclass
class Loaded:
    """What a load restored, and what the caller restores itself."""

    folder: Path
    step: int
    training: dict  # the run's own fields (sampler position, counters)
    same_layout: bool  # random streams restored (else fresh ones, see reseed_rng)
    bytes_read: int


class SavedPieces:
    """The saved pieces of each parameter, indexed, and the files they live in."""

    def __init__(self, folder: Path, manifest: dict) -> None:
        self.folder = folder
        self.records = [record_from_json(f) for f in manifest["files"]]
        self.readers: dict[int, FileReader] = {}
        self.pieces: dict[str, list[dict]] = {}
        for p in manifest["pieces"]:
            self.pieces.setdefault(p["name"], []).append(p)
        self.shapes = {n: tuple(t["shape"]) for n, t in manifest["tensors"].items()}
        self.index = {n: RunIndex(self.region(n, p) for p in ps)
                      for n, ps in self.pieces.items()}
        self.bytes_read = 0

    def region(self, name: str, piece: dict) -> Region:
        split = piece["split"] or (None, 0, 0)
        more = tuple(tuple(c) for c in piece.get("more", ()))
        return Region(self.shapes[name], split[0], split[1], split[2], *piece["flat"], more)

    def reader(self, file_index: int) -> FileReader:
        if file_index not in self.readers:
            record = self.records[file_index]
            self.readers[file_index] = FileReader(self.folder / record.name, record)
        return self.readers[file_index]

    def has(self, name: str, state: str) -> bool:
        pieces = self.pieces.get(name, [])
        return bool(pieces) and all(state in p["keys"] for p in pieces)

    @torch.no_grad()
    def fill(self, dst: torch.Tensor, name: str, state: str, wanted: Region) -> None:
        """dst (1-D, wanted.numel elements) <- the saved `state` of `wanted`."""
        found = self.index[name].find(wanted) if name in self.index else []
        if sum(o.length for o in found) != wanted.numel:
            raise PartitaError(
                f"checkpoint '{self.folder}' lacks part of '{name}' ({state}): its pieces "
                "do not cover the slice this rank needs. The checkpoint is incomplete; "
                "resume from another one."
            )
        by_source: dict[int, list] = {}
        for o in found:
            by_source.setdefault(o.source, []).append(o)
        for source, parts in by_source.items():
            piece = self.pieces[name][source]
            lo = min(o.src for o in parts)
            hi = max(o.src + o.length for o in parts)
            # One read (and one checksum pass) per saved piece: the span it must give.
            span = self.reader(piece["file"]).read(piece["keys"][state], lo, hi)
            self.bytes_read += span.numel() * span.element_size()
            for o in parts:
                dst[o.dst:o.dst + o.length].copy_(span[o.src - lo:o.src - lo + o.length])

    def read_whole(self, file_index: int, key: str) -> torch.Tensor:
        reader = self.reader(file_index)
        return reader.read(key, 0, reader.tensors[key].numel).clone()

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def check_tensors(manifest: dict, pm, folder: Path) -> None:
    """Every parameter this rank holds must be in the checkpoint with its global shape."""
    saved = {n: tuple(t["shape"]) for n, t in manifest["tensors"].items()}
    problems = []
    for sl in pm.dp.owned_slices():
        for pc in sl.pieces:
            info = pc.entry.info
            if info.name not in saved:
                problems.append(f"'{info.name}' is not in it")
            elif saved[info.name] != tuple(info.global_shape):
                problems.append(f"'{info.name}' has shape {list(saved[info.name])} there, "
                                f"{list(info.global_shape)} here")
    if problems:
        raise CheckpointMismatch(
            f"checkpoint '{folder}' does not fit this model: {'; '.join(problems[:3])}"
            f"{' and more' if len(problems) > 3 else ''}. Resume with the model it was "
            "written for, or start a fresh run."
        )


@torch.no_grad()
def load_checkpoint(pm, folder: str | Path, seed: int = 0) -> Loaded:
    """Load the checkpoint in `folder` into this rank's part of `pm`. Every rank calls
    it: the ranks agree whether each read its part (if any failed, the lowest-numbered
    of those raises its error and the others `PeerReported`), and stages 1-2 then
    rebuild their full parameter buffers collectively."""
    folder = Path(folder)
    sources = None
    try:
        # Every process reads and checks its own part; what one finds wrong (a damaged
        # file, another model) stops them all, with one message, before the collective.
        try:
            manifest = _usable_manifest(pm, folder)
            sources = SavedPieces(folder, manifest)
            loaded = _read_own_part(pm, folder, manifest, sources, seed)
        except Exception as exc:
            if isinstance(exc, (KeyError, IndexError, TypeError)):
                # A manifest whose checksum matches but whose entries do not fit each
                # other (edited by hand, or written by another tool): say so, with the
                # entry, rather than report a fault inside partita.
                exc = CheckpointFileError(
                    f"the manifest of checkpoint '{folder}' does not hold together "
                    f"({type(exc).__name__}: {exc}); it was edited, or written by "
                    "something else. Resume from another checkpoint.")
            stop_together(exc, pm.device, "reading the checkpoint")
            raise  # not reached: stop_together raises
        stop_together(None, pm.device, "reading the checkpoint")
        pm.dp.owned_slices_loaded()
        return loaded
    finally:
        if sources is not None:
            sources.close()


def _usable_manifest(pm, folder: Path) -> dict:
    """The checkpoint's manifest, once it is known to fit `pm` and partita's optimizer."""
    manifest = read_manifest(folder)
    check_model(manifest, pm.model_cfg, folder)
    check_tensors(manifest, pm, folder)
    name = manifest.get("optimizer", {}).get("name")
    if name != "adamw":
        raise CheckpointMismatch(
            f"checkpoint '{folder}' holds the state of optimizer '{name}', but partita "
            "trains with AdamW; it cannot continue that optimizer's run."
        )
    return manifest


def _read_own_part(pm, folder: Path, manifest: dict, sources: SavedPieces,
                   seed: int) -> Loaded:
    """`load_checkpoint` up to its collective: this rank's slices, optimizer step and
    scaler, and its random state."""
    for sl in pm.dp.owned_slices():
        for pc in sl.pieces:
            info = pc.entry.info
            wanted = Region.of(info, pc.start, pc.stop)
            offset = pc.buf_start - sl.lo
            part = slice(offset, offset + wanted.numel)
            best = MASTER if sources.has(info.name, MASTER) else WEIGHTS
            same_dtype = manifest["precision"]["param_dtype"] == str(sl.param.dtype)
            sources.fill(sl.param[part], info.name, WEIGHTS if same_dtype else best,
                         wanted)
            if sl.master is not None:
                sources.fill(sl.master[part], info.name, best, wanted)
            sources.fill(sl.exp_avg[part], info.name, EXP_AVG, wanted)
            sources.fill(sl.exp_avg_sq[part], info.name, EXP_AVG_SQ, wanted)
    pm.dp.step_count = int(manifest["optimizer"]["steps"])
    pm.dp.scaler.load_state_dict(manifest["scaler"])
    mesh = pm.mesh
    saved = manifest.get("layout", {})
    same_layout = (manifest["world_size"] == mesh.world_size
                   and all(saved.get(k) == getattr(mesh.dims, k) for k in DEGREES))
    if same_layout:
        index = next((i for i, f in enumerate(manifest["files"]) if f["rank"] == mesh.rank),
                     None)
        if index is None:
            raise CheckpointFileError(
                f"the manifest of checkpoint '{folder}' lists no file of rank {mesh.rank}, "
                f"though it was written by {manifest['world_size']} processes: it is "
                "incomplete or was edited. Resume from another checkpoint.")
        same_layout = holds_every_stream(pm.module, pm.device,
                                         sources.reader(index).tensors)
    if same_layout:
        restore_rng(pm.module, pm.device, manifest["files"][index]["rng"],
                    lambda key: sources.read_whole(index, key))
    else:
        reseed_rng(pm.module, pm.device, seed, mesh.rank, manifest["step"])
    return Loaded(folder, int(manifest["step"]), manifest.get("training", {}),
                  same_layout, sources.bytes_read)

