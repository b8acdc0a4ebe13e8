"""Subcommands of the `partita` command line, one module each, and what they share."""

from __future__ import annotations

import os
from pathlib import Path

from partita.errors import PartitaError

# Picture formats matplotlib writes with its own backends and Pillow (one of its
# dependencies), named here so that checking a file name does not import it.
PICTURE_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff",
                   "webp")


def check_output_file(path: str, option: str, formats: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, a file option whose folder does not exist or cannot be
    written (or, given `formats`, whose name does not end in one of them), rather than
    failing at the end with the operating system's or the writer's error."""
    if not path.strip():
        raise PartitaError(f"{option} is empty: give a file name, e.g. {option} out.png.")
    folder = Path(path).expanduser().parent
    # A file where a folder of the path should be (sched.png/x.png): named as what it is.
    if (blocker := next((p for p in (folder, *folder.parents) if p.exists()), None)) \
            is not None and not blocker.is_dir():
        raise PartitaError(f"{option} {path}: {blocker} is a file, not a folder. Choose a "
                           "file in an existing folder.")
    if not folder.is_dir():
        raise PartitaError(f"{option} {path}: the folder {folder} does not exist. Create it "
                           "or choose a file in an existing folder.")
    if not os.access(folder, os.W_OK):
        raise PartitaError(f"{option} {path}: the folder {folder} cannot be written. Choose "
                           "a file in a folder you can write to.")
    if Path(path).is_dir():
        raise PartitaError(f"{option} {path} is a folder; give a file name, e.g. "
                           f"{Path(path) / 'out.png'}.")
    suffix = Path(path).suffix.lower().lstrip(".")
    if formats and suffix not in formats:
        got = f"'.{suffix}'" if suffix else "no extension"
        raise PartitaError(f"{option} {path}: the file name has {got}, and the format is "
                           "read from it; end it in one of "
                           f"{', '.join('.' + f for f in formats)}, e.g. "
                           f"{Path(path).with_suffix('.png')}.")
    # The permission bits do not tell everything (a superuser, /proc, a read-only
    # mount): open the file as the writer will, and leave no empty file behind.
    target = Path(path).expanduser()
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as exc:
        raise PartitaError(f"{option} {path} cannot be written ({exc.strerror or exc}). "
                           "Choose a file in a folder you can write to.") from None
    if not existed:
        target.unlink(missing_ok=True)
