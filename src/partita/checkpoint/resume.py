"""Where a run keeps its checkpoints, and which one it resumes from."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from partita.checkpoint.manifest import (
    STEP_DIR,
    all_damaged,
    complete_checkpoints,
    find_latest,
    read_manifest,
    resolve,
    write_latest,
)
from partita.config import Config
from partita.errors import PartitaError


def checkpoint_root(cfg: Config) -> Path:
    """Where the run's checkpoints live: train.checkpoint_dir, else OUT_DIR/checkpoints."""
    return Path(cfg.train.checkpoint_dir or Path(cfg.train.out_dir) / "checkpoints")


def resume_target(cfg: Config, restarted: bool = False) -> Path | None:
    """The checkpoint this run starts from: train.resume resolved ("auto": the newest
    complete one, or None for a fresh start). A worker restarted by the launcher
    (--max-restarts) resumes from the newest checkpoint in the run's folder, or from
    train.resume when the run has saved none there."""
    wanted = cfg.train.resume or ("auto" if restarted else "")
    if restarted and wanted != "auto":
        # What the run saved since it started is newer than the checkpoint it was told
        # to start from. Nothing else there is: at launch a roll-back's later branch was
        # set aside, and another run's checkpoints refused or deleted (`partita train`).
        given, latest = resolve(Path(wanted)), find_latest(checkpoint_root(cfg))
        return latest if latest is not None and _step(latest) > _step(given) else given
    if not wanted:
        return None
    if wanted == "auto":
        root = checkpoint_root(cfg)
        latest = find_latest(root)
        if latest is None and (damaged := all_damaged(root, "train.resume=auto")):
            raise damaged
        return latest
    return resolve(Path(wanted))


def _step(folder: Path) -> int:
    """The checkpoint's step: from its folder name, else (a copy under another name)
    from its manifest; -1 when neither tells."""
    if found := STEP_DIR.match(folder.name):
        return int(found.group(1))
    try:
        return int(read_manifest(folder)["step"])
    except (PartitaError, KeyError, TypeError, ValueError):
        return -1


def in_checkpoint_root(target: Path, root: Path) -> bool:
    """Whether `target` is one of the step folders of the checkpoint folder `root`:
    resuming it continues (or rolls back) the run whose checkpoints are there, where any
    other target starts a branch of another run (or of a set-aside one)."""
    return bool(STEP_DIR.match(target.name)) and target.parent.resolve() == root.resolve()


def resumes_own(cfg: Config, target: Path | None) -> bool:
    """Whether `target` is in this run's own checkpoint folder (`in_checkpoint_root`)."""
    return target is not None and in_checkpoint_root(target, checkpoint_root(cfg))


def continues_run(cfg: Config, target: Path | None) -> bool:
    """Whether starting from `target` continues the run that saved it rather than
    branching off it: `target` is in this run's checkpoint folder, or in
    OUT_DIR/checkpoints (that run's, when this one moves its checkpoints with
    train.checkpoint_dir). A continued run keeps the run id its checkpoints carry."""
    return resumes_own(cfg, target) or (
        target is not None
        and in_checkpoint_root(target, Path(cfg.train.out_dir) / "checkpoints"))


def set_aside_later_branch(target: Path, root: Path) -> list[Path]:
    """Rename the checkpoints in `root` newer than `target`, when a run resumes from an
    older checkpoint of its own folder (a roll-back, say after a loss spike), to
    `abandoned-<name>-<time>`; point `latest` at `target`. Left as they were, they
    would pass for this run's: `resume=auto` takes the newest checkpoint, which would
    return to the abandoned branch, and this run's own saves would replace them one by
    one. Nothing is deleted. Returns the new names. (A target outside `root` never gets
    here with checkpoints in `root`: `partita train` refuses or deletes them first.)"""
    if not in_checkpoint_root(target, root):
        return []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    moved = []
    for folder in complete_checkpoints(root):
        if _step(folder) > _step(target):
            aside = folder.with_name(f"abandoned-{folder.name}-{stamp}")
            folder.rename(aside)
            moved.append(aside)
    if moved:
        write_latest(root, target.name)
    return moved


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
