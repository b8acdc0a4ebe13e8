"""The run's output folder: checked before launch, never shared by two runs.

A run writes `config.toml`, `metrics.jsonl`, TensorBoard events and at its end
`model.safetensors` (with `train.export`, also an export folder such as `hf/`) into
`train.out_dir`. Everything that can go wrong with that folder
is found before any process starts: a path that is a file, a folder that cannot be
written (permissions, a read-only mount), too little free space for the weights, and
another run's results already there; an empty `train.out_dir` (the current folder) is
refused. The checkpoint folder gets the same checks of what it is and whether it can be
written (`prepare_folder`). Re-using a folder needs `train.overwrite`, and then the old
results are removed first, so a new run that dies early never leaves the previous run's
weights looking like its own. A live job's folders are held by it alone
(`partita.folder_lock`). The folder's `run-id` names the run whose results these are;
its checkpoints carry the same id, so a resume that would append to another run's
results is refused (`partita train`).
"""

from __future__ import annotations

import copy
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from partita.errors import PartitaError

if TYPE_CHECKING:
    import torch

    from partita.config import Config

# Files a run writes; any of them present means the folder holds a run's results.
RESULT_FILES = ("config.toml", "metrics.jsonl", "model.safetensors")
# Folders `train.export` writes into out_dir, one per format (`export.FORMATS`).
EXPORT_FOLDERS = ("hf",)
# The id of the run whose results the folder holds (one line of hex); a run that
# continues from its own checkpoints keeps it, any other run writes a new one.
RUN_ID_FILE = "run-id"
PARTIAL_SUFFIX = ".partial"  # a file being written; renamed into place when complete
# Room kept beyond the weights' own size: metrics, config, filesystem overhead.
SPARE_BYTES = 16 << 20
OUT_DIR = "train.out_dir"


def prepare_out_dir(out_dir: str | os.PathLike, overwrite: bool, bytes_needed: int,
                    resuming: bool = False) -> Path:
    """Create and check `out_dir` for a new run (or, `resuming`, for the continuation
    of the run whose results are there); raise PartitaError saying what to fix."""
    path = prepare_folder(check_out_dir(out_dir, overwrite, resuming), OUT_DIR)
    remove_partial_files(path)
    if not resuming:
        for name in _results(path):
            (path / name).unlink()
        (path / RUN_ID_FILE).unlink(missing_ok=True)
        # The previous run's export: left in place, it would pass for this run's.
        for name in EXPORT_FOLDERS:
            if (path / name).is_dir():
                shutil.rmtree(path / name)
        for events in path.glob("events.out.tfevents.*"):
            events.unlink()
    free = shutil.disk_usage(path).free
    if free < bytes_needed + SPARE_BYTES:
        raise PartitaError(
            f"train.out_dir '{path}' has {free / 2**20:,.0f} MiB free but the run will write "
            f"about {(bytes_needed + SPARE_BYTES) / 2**20:,.0f} MiB (its weights, the config "
            "and metrics); free some space or choose a folder on another disk."
        )
    return path


def check_out_dir(out_dir: str | os.PathLike, overwrite: bool, resuming: bool = False,
                  auto_found_nothing: bool = False, branch_of: Path | None = None) -> Path:
    """The checks of `prepare_out_dir` that change nothing: `out_dir` is given (not empty:
    that would be the current folder), is not a file, and holds no other run's results
    unless `overwrite` (or `resuming` that run: its own checkpoint, not just any).
    `auto_found_nothing`: train.resume=auto was asked for and found no checkpoint;
    `branch_of`: the run starts from that checkpoint of another run. The message then
    says so."""
    path = check_folder(given_out_dir(out_dir), OUT_DIR)
    found = [] if resuming or not path.is_dir() else _results(path)
    if found and not overwrite and _trained(path) and branch_of is not None:
        raise PartitaError(
            f"train.out_dir '{path}' already holds another run's results "
            f"({', '.join(found)}), and this run starts from {branch_of}, a checkpoint "
            "of another run; choose a new folder for it with --train.out_dir=PATH, or "
            "replace them with --train.overwrite=true."
        )
    if found and not overwrite and _trained(path) and auto_found_nothing:
        raise PartitaError(
            f"train.resume=auto found no checkpoint of the run in '{path}' (a run saves "
            "them with train.checkpoint_every > 0, or when a signal stops it), so it "
            "cannot go on where it stopped; its results "
            f"({', '.join(found)}) are kept. To train on from its final "
            f"weights, export them (partita export {path} --format hf --out DIR) and "
            "start a new run with --model.init_from=DIR; or replace the results with "
            "--train.overwrite=true."
        )
    if found and not overwrite and _trained(path):
        # No resume hint: a run with checkpoints to continue is refused earlier, by the
        # check of its checkpoint folder, whose message offers --train.resume=auto.
        raise PartitaError(
            f"train.out_dir '{path}' already holds another run's results ({', '.join(found)}); "
            "choose a new folder with --train.out_dir=PATH, or replace them with "
            "--train.overwrite=true (that run saved no checkpoint to continue from)."
        )
    return path


def given_out_dir(out_dir: str | os.PathLike) -> Path:
    """`out_dir` as a Path; PartitaError when it is empty (Path("") is the current
    folder, which would mix the run's results, checkpoints included, with whatever is
    there)."""
    if not os.fspath(out_dir).strip():
        raise PartitaError(
            f"{OUT_DIR} is empty, which would write the run's results into the current "
            f"folder; give a folder of its own, e.g. --{OUT_DIR}=runs/NAME (it is created "
            "when missing)."
        )
    return Path(out_dir)


def check_folder(folder: str | os.PathLike, setting: str) -> Path:
    """`folder` as a Path, refused (PartitaError naming `setting`) when it is a file."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise PartitaError(f"{setting} '{path}' is a file, not a folder; give the path "
                           "of a folder (it is created when missing).")
    return path


def prepare_folder(folder: str | os.PathLike, setting: str) -> Path:
    """Create `folder` (and its parents) and prove that files can be written in it;
    PartitaError naming `setting` when it is a file or cannot be created or written."""
    path = check_folder(folder, setting)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".partita-write-test-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        raise PartitaError(
            f"{setting} '{path}' cannot be written ({exc.strerror or exc}); choose a "
            "folder on a writable disk, or fix its permissions."
        ) from None
    return path


def read_run_id(out_dir: str | os.PathLike) -> str | None:
    """The run id recorded in `out_dir` (None where there is none: no run yet, or a run
    of a version that wrote none)."""
    try:
        text = (Path(out_dir) / RUN_ID_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def other_run_in(out_dir: str | os.PathLike, run_id: str | None) -> str | None:
    """The run id of `out_dir`'s results when they are a run's other than `run_id`'s
    (both ids known and different, and that run trained at least a step), else None."""
    theirs = read_run_id(out_dir)
    if run_id and theirs and theirs != run_id and _trained(Path(out_dir)):
        return theirs
    return None


def run_id_for(continued: str | None, device: torch.device) -> str:
    """The id of a run starting now: `continued`, the id of the run it continues from
    its checkpoint; else a new one, drawn by process 0 and the same on every process
    (call it on all of them)."""
    if continued:
        return continued
    import torch.distributed as dist

    from partita.agreement import over_all_ranks

    first = not dist.is_initialized() or dist.get_rank() == 0
    (drawn,) = over_all_ranks([float(secrets.randbits(48) if first else 0)],
                              dist.ReduceOp.MAX, device)
    return f"{int(drawn):012x}"


def write_run_id(out_dir: str | os.PathLike, run_id: str) -> None:
    """Record `run_id` in `out_dir`, whole or not at all (a temporary name, renamed)."""
    path = Path(out_dir) / RUN_ID_FILE
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    partial.write_text(run_id + "\n")
    os.replace(partial, path)


def _results(path: Path) -> list[str]:
    return [name for name in RESULT_FILES if (path / name).exists()]


def _trained(path: Path) -> bool:
    """Whether the run whose results are in `path` got anywhere: weights, or at least
    one logged step. A run that died before its first step leaves only its config and
    an empty metrics file, which a new run may replace without being told to."""
    metrics = path / "metrics.jsonl"
    return (path / "model.safetensors").exists() or (metrics.exists()
                                                     and metrics.stat().st_size > 0)


def remove_partial_files(path: Path) -> None:
    """Remove files (and export folders) a killed writer left half-written; they never
    look complete."""
    for partial in path.glob(f"*{PARTIAL_SUFFIX}"):
        if partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink(missing_ok=True)


def weight_bytes(num_params: int, dtype_bytes: int) -> int:
    """Bytes of the final weights file (full, unsharded; at least 4 bytes per value)."""
    return num_params * max(dtype_bytes, 4)


def with_absolute_inputs(cfg: Config) -> Config:
    """`cfg` with every relative input path that exists from the working directory made
    absolute (model.init_from, data.source, data.tokenizer, data.mix's sources), so a
    run's config.toml means the same from any directory (`partita generate --run`,
    `partita export`, a resume started elsewhere). A value that is no path from here,
    such as a built-in name, stays as it is."""
    def absolute(value: str) -> str:
        path = Path(value).expanduser()
        return str(path.resolve()) if value and not path.is_absolute() and path.exists() \
            else value

    out = copy.deepcopy(cfg)
    out.model.init_from = absolute(cfg.model.init_from)
    out.data.source = absolute(cfg.data.source)
    out.data.tokenizer = absolute(cfg.data.tokenizer)
    if cfg.data.mix:
        # The data package's own reading of the entries: a source may hold a comma.
        from partita.data.mix import split_mix

        out.data.mix = ", ".join(f"{absolute(source)}={weight}" if weight else source
                                 for source, weight in split_mix(cfg.data.mix))
    return out
