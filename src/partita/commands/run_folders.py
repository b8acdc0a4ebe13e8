"""A run's folders, before launch: checked changing nothing (`check_run_dir`), then
created, proven writable, locked and cleared of an earlier run's results
(`prepare_run_dir`). `partita train` calls both before any process starts; under
torchrun rank 0 does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sys
from pathlib import Path

from partita.checkpoint import check_model, complete_checkpoints, read_manifest
from partita.checkpoint.manifest import check_files
from partita.checkpoint.resume import (
    checkpoint_root,
    continues_run,
    resume_target,
    resumes_own,
    set_aside_later_branch,
)
from partita.commands.train_notes import draws_timeline
from partita.config import Config
from partita.errors import PartitaError
from partita.folder_lock import LOCK_FILE, check_not_in_use, lock_folder
from partita.run_dir import (
    OUT_DIR,
    check_folder,
    check_out_dir,
    given_out_dir,
    other_run_in,
    prepare_folder,
    prepare_out_dir,
    weight_bytes,
)


def check_run_dir(cfg: Config) -> Path | None:
    """Check, changing nothing, the checkpoint to resume from (it must exist, be whole
    and be of this model), that train.out_dir, the checkpoint folder and the folder of
    train.timeline_png are folders (or missing), and that the first two hold no earlier
    run's results unless train.overwrite; the checkpoint, or None."""
    given_out_dir(cfg.train.out_dir)  # before any path is derived from it
    check_folder(checkpoint_root(cfg), checkpoint_setting(cfg))
    # A live job's folders are refused first: what is in them is still changing.
    check_not_in_use(cfg.train.out_dir, OUT_DIR)
    check_not_in_use(checkpoint_root(cfg), checkpoint_setting(cfg))
    timeline_folder(cfg)
    target = resume_target(cfg)
    if target is not None:
        manifest = read_manifest(target)
        check_model(manifest, cfg.model_config(), target)
        check_files(target, manifest)
        from partita.data.sampler import check_resumable  # numpy: only when resuming

        check_resumable(manifest.get("training", {}).get("sampler", {}),
                        {"seed": cfg.data.seed, "seq_len": cfg.data.seq_len,
                         "global_batch": cfg.train.global_batch})
    own = resumes_own(cfg, target)
    earlier = [] if own else complete_checkpoints(checkpoint_root(cfg))
    if earlier and not cfg.train.overwrite:
        if target is not None:
            # Branching into a folder of another run's checkpoints: newer ones there would
            # pass for this run's (resume=auto and restarts take the newest).
            raise PartitaError(
                f"{checkpoint_root(cfg)} holds checkpoints of an earlier run (newest: "
                f"{earlier[-1].name}), and this run starts from {target}, which is not one "
                "of them: their saves would mix, and --train.resume=auto or a restart "
                "could return to that run's. Choose another train.out_dir (or "
                "train.checkpoint_dir) for this run, or delete them with "
                "--train.overwrite=true; --train.resume=auto continues that run instead."
            )
        raise PartitaError(
            f"{checkpoint_root(cfg)} holds checkpoints of an earlier run (newest: "
            f"{earlier[-1].name}); continue it with --train.resume=auto, choose another "
            "train.out_dir (or train.checkpoint_dir), or start over with "
            "--train.overwrite=true, which deletes them."
        )
    saved_by = run_id_of(target) if target is not None else None
    if continues_run(cfg, target) and not cfg.train.overwrite and (
            other := other_run_in(cfg.train.out_dir, saved_by)):
        raise PartitaError(
            f"train.out_dir '{cfg.train.out_dir}' holds the results of run {other}, but "
            f"{target} is a checkpoint of run {saved_by}: resuming it there would "
            "append its metrics to the other run's. Give it its own folder with "
            "--train.out_dir=PATH (its metrics then start after the checkpoint's step), "
            "or replace those results with --train.overwrite=true."
        )
    continues = continues_out_dir(cfg, target)
    check_out_dir(cfg.train.out_dir, cfg.train.overwrite, resuming=continues,
                  auto_found_nothing=target is None and cfg.train.resume == "auto",
                  branch_of=None if continues else target)
    return target


def prepare_run_dir(cfg: Config, lock: bool = True) -> list:
    """Check and claim train.out_dir for this run (see partita.run_dir): `check_run_dir`,
    create the folders the run writes into, lock them (`lock`: see partita.folder_lock;
    the locks last while the returned files stay open), then, with train.overwrite,
    remove the earlier run's checkpoints and results."""
    target = check_run_dir(cfg)
    folders = [(given_out_dir(cfg.train.out_dir), OUT_DIR),
               (checkpoint_root(cfg), checkpoint_setting(cfg))]
    if (png_folder := timeline_folder(cfg)) is not None:
        folders.append((png_folder, TIMELINE_FOLDER))
    made = [Path(folder) for folder, _ in folders if not Path(folder).exists()]
    locks: list = []
    new_lock_files: list[Path] = []  # removed again when the run is refused
    try:
        # Every folder the run writes is made and proven writable before anything of an
        # earlier run is removed (and not after training, where a failure loses the run).
        root = [prepare_folder(folder, setting) for folder, setting in folders][1]
        if lock:  # the run's folders are this job's alone until it ends (folder_lock)
            # The default checkpoint folder is inside out_dir, whose lock covers it (and
            # a run that saved nothing removes it, which a lock file in it would stop).
            mine = folders[:2] if cfg.train.checkpoint_dir else folders[:1]
            seen = set()  # one lock per folder: a second flock of it would refuse itself
            for folder, setting in mine:
                if (where := Path(folder).resolve()) not in seen:
                    seen.add(where)
                    if not (where / LOCK_FILE).exists():
                        new_lock_files.append(where / LOCK_FILE)
                    locks.append(lock_folder(folder, setting))
        if not resumes_own(cfg, target):  # a fresh run, or a branch of another run's
            for folder in complete_checkpoints(root):
                shutil.rmtree(folder)
            (root / "latest").unlink(missing_ok=True)
        wide = "float64" in (cfg.train.dtype, cfg.precision.param_dtype)
        prepare_out_dir(cfg.train.out_dir, cfg.train.overwrite,
                        weight_bytes(cfg.model_config().num_params(), 8 if wide else 4),
                        resuming=continues_out_dir(cfg, target))
        if target is not None and (moved := set_aside_later_branch(target, root)):
            print(f"partita: note: resuming {target.name}, older than the checkpoints "
                  f"after it in {root}; those are kept, set aside as "
                  f"{', '.join(p.name for p in moved)}, so that this run's saves and "
                  "--train.resume=auto continue from here.", file=sys.stderr, flush=True)
    except PartitaError:
        # Refused (too little space, say): the folders made for it go again, innermost
        # first; one that something else wrote into stays.
        for path in new_lock_files:
            path.unlink(missing_ok=True)
        for handle in filter(None, locks):
            handle.close()
        for folder in sorted(made, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return locks


def continues_out_dir(cfg: Config, target: Path | None) -> bool:
    """Whether resuming `target` continues the run whose results are in train.out_dir:
    it continues the run that saved it (`continues_run`), and out_dir holds no other
    run's results (by the run ids of both, where both have one)."""
    return continues_run(cfg, target) and other_run_in(cfg.train.out_dir,
                                                       run_id_of(target)) is None


def run_id_of(checkpoint: Path) -> str | None:
    """The id of the run that saved `checkpoint` (None for checkpoints written before
    runs had ids)."""
    return read_manifest(checkpoint).get("training", {}).get("run_id")


def checkpoint_setting(cfg: Config) -> str:
    """How messages name the checkpoint folder (see `checkpoint_root`)."""
    if cfg.train.checkpoint_dir:
        return "train.checkpoint_dir"
    return "train.checkpoint_dir (unset: OUT_DIR/checkpoints)"


TIMELINE_FOLDER = "the folder of train.timeline_png"


def timeline_folder(cfg: Config) -> Path | None:
    """The folder the run draws train.timeline_png into (created when missing, like
    train.out_dir), checked changing nothing; None when the run draws no timeline."""
    if not draws_timeline(cfg):
        return None
    if importlib.util.find_spec("matplotlib") is None:  # found now, not after training
        raise PartitaError("train.timeline_png needs matplotlib to draw the timeline: pip "
                           "install matplotlib (or pip install 'partita[plot]'), or leave "
                           "train.timeline_png unset.")
    png = Path(cfg.train.timeline_png)
    if png.is_dir():
        raise PartitaError(f"train.timeline_png '{png}' is a folder; give the name of a "
                           f"PNG file, e.g. {png / 'timeline.png'}.")
    return check_folder(png.parent, TIMELINE_FOLDER)
