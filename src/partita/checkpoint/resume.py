"""Where a run keeps its checkpoints, and which one it resumes from."""

from __future__ import annotations

from pathlib import Path

from partita.checkpoint.manifest import all_damaged, find_latest, resolve
from partita.config import Config


def checkpoint_root(cfg: Config) -> Path:
    """Where the run's checkpoints live: train.checkpoint_dir, else OUT_DIR/checkpoints."""
    return Path(cfg.train.checkpoint_dir or Path(cfg.train.out_dir) / "checkpoints")


def resume_target(cfg: Config, restarted: bool = False) -> Path | None:
    """The checkpoint this run starts from: train.resume resolved ("auto": the newest
    complete one, or None for a fresh start). A worker restarted by the launcher
    (--max-restarts) resumes as with "auto" when nothing else was asked."""
    wanted = cfg.train.resume or ("auto" if restarted else "")
    if not wanted:
        return None
    if wanted == "auto":
        root = checkpoint_root(cfg)
        latest = find_latest(root)
        if latest is None and (damaged := all_damaged(root, "train.resume=auto")):
            raise damaged
        return latest
    return resolve(Path(wanted))
