"""Where a run keeps its checkpoints, and which one it resumes from."""

from __future__ import annotations

import os
import sys
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


def restart_target(cfg: Config, rank: int) -> Path | None:
    """`resume_target` for a worker of `partita train`: one restarted by the launcher
    (--max-restarts) resumes as with "auto", and its rank 0 says so once, after the
    failure's own message."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    target = resume_target(cfg, restarts > 0)
    if restarts and rank == 0:
        print(f"partita: restart {restarts} of "
              f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} after a process of the "
              f"job failed; resuming from "
              f"{target if target is not None else 'the start (no checkpoint yet)'}",
              file=sys.stderr, flush=True)
    return target
