"""Checkpoints: sharded, crash-safe, loadable into any layout of the same model.

    writer = CheckpointWriter(root, rank, world, keep_last=3)
    writer.save(step, pm, manifest_fields(pm, training={...}))
    loaded = load_checkpoint(pm, find_latest(root))

The format is documented in docs/checkpoints.md: a folder per step with one
safetensors file per rank and a JSON manifest written last.

Finding, reading and checking a manifest needs no torch (`partita train` refuses a
wrong checkpoint before it imports torch); the names that read or write tensors load
on first use.
"""

from __future__ import annotations

from partita.checkpoint.manifest import (
    CheckpointFileError,
    CheckpointMismatch,
    check_model,
    complete_checkpoints,
    find_latest,
    read_manifest,
    resolve,
    step_dir_name,
)
from partita.lazy import lazy_names

_LAZY = {"Loaded": "partita.checkpoint.reader", "load_checkpoint": "partita.checkpoint.reader",
         "CheckpointWriter": "partita.checkpoint.writer", "SaveReport": "partita.checkpoint.writer",
         "manifest_fields": "partita.checkpoint.writer"}

__all__ = [
    "CheckpointFileError", "CheckpointMismatch", "CheckpointWriter", "Loaded", "SaveReport",
    "check_model", "complete_checkpoints", "find_latest", "load_checkpoint",
    "manifest_fields", "read_manifest", "resolve", "step_dir_name",
]

__getattr__ = lazy_names(__name__, _LAZY)
