"""Checkpoints: sharded, crash-safe, loadable into any layout of the same model.

    writer = CheckpointWriter(root, rank, world, keep_last=3)
    writer.save(step, pm, manifest_fields(pm, training={...}))
    loaded = load_checkpoint(pm, find_latest(root))

The format is documented in docs/checkpoints.md: a folder per step with one
safetensors file per rank and a JSON manifest written last.
"""

from partita.checkpoint.files import CheckpointFileError
from partita.checkpoint.manifest import (
    complete_checkpoints,
    find_latest,
    read_manifest,
    resolve,
    step_dir_name,
)
from partita.checkpoint.reader import CheckpointMismatch, Loaded, check_model, load_checkpoint
from partita.checkpoint.writer import CheckpointWriter, SaveReport, manifest_fields

__all__ = [
    "CheckpointFileError", "CheckpointMismatch", "CheckpointWriter", "Loaded", "SaveReport",
    "check_model", "complete_checkpoints", "find_latest", "load_checkpoint",
    "manifest_fields", "read_manifest", "resolve", "step_dir_name",
]
