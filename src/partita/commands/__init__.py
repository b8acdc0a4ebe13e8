"""Subcommands of the `partita` command line, one module each, and what they share."""

from __future__ import annotations

import os
from pathlib import Path

from partita.errors import PartitaError


def check_output_file(path: str, option: str) -> None:
    """Refuse, before any work, a file option whose folder does not exist or cannot be
    written, rather than failing at the end with the operating system's error."""
    folder = Path(path).expanduser().parent
    if not folder.is_dir():
        raise PartitaError(f"{option} {path}: the folder {folder} does not exist. Create it "
                           "or choose a file in an existing folder.")
    if not os.access(folder, os.W_OK):
        raise PartitaError(f"{option} {path}: the folder {folder} cannot be written. Choose "
                           "a file in a folder you can write to.")
    if Path(path).is_dir():
        raise PartitaError(f"{option} {path} is a folder; give a file name, e.g. "
                           f"{Path(path) / 'out.png'}.")
