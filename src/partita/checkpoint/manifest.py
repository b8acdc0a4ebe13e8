"""The checkpoint folder: its manifest, the `latest` pointer, finding and pruning, and
the checks a manifest allows (files present, the model it was written for). No torch.

    CHECKPOINT_ROOT/                 train.checkpoint_dir (default OUT_DIR/checkpoints)
      latest                         the newest complete checkpoint's folder name
      step-00000400/
        manifest.json                written last: what makes the folder a checkpoint
        rank-00000-of-00004.safetensors
        ...
      step-00000500.3f9c2a.partial/  being written (or abandoned by a crash): never read

A folder is a checkpoint only when its manifest is there, parses, and matches its own
checksum; it is renamed from its `.partial` name only after that, so a reader never
sees a half-written one under a checkpoint's name (docs/checkpoints.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import zlib
from pathlib import Path

from partita.errors import PartitaError
from partita.models.model_config import padded_vocab

FORMAT = "partita-checkpoint"
# The newest format version this partita reads. 2: a piece may be cut along several
# dimensions ("more"); a checkpoint without such pieces is still written as version 1.
VERSION = 2
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
PARTIAL = ".partial"

# The model settings that decide what the saved numbers mean; a checkpoint loads only
# into a model that agrees on all of them.
ARCHITECTURE_KEYS = ("vocab_size", "vocab_multiple", "dim", "n_layers", "n_heads",
                     "n_kv_heads", "ffn_dim", "flavour", "tie_embeddings", "rope_theta",
                     "norm_eps", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor", "rope_original_max_len", "n_experts",
                     "qkv_bias")
# Recorded only for mixture-of-experts models (n_experts > 0). The first four shape the
# weights and must match on resume; the routing settings may change (fine-tuning with
# another capacity, say), and a resume that changes them says so.
MOE_ARCHITECTURE_KEYS = ("moe_every", "expert_ffn_dim", "shared_experts")
MOE_ROUTING_KEYS = ("top_k", "capacity_factor", "router_gating", "router_norm_topk",
                    "aux_loss_weight", "z_loss_weight")


class CheckpointFileError(PartitaError):
    """A checkpoint file is missing, truncated or corrupt (the message names it)."""


class NoSoundCheckpoint(CheckpointFileError):
    """A folder holds checkpoints, but the manifest of every one is damaged."""


class CheckpointMismatch(PartitaError):
    """The checkpoint is sound but belongs to another model or optimizer."""


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_fields(model_cfg) -> dict:
    """The architecture of a ModelConfig, as a checkpoint records it (with its routing
    settings for a mixture-of-experts model)."""
    keys = ARCHITECTURE_KEYS
    if getattr(model_cfg, "n_experts", 0):
        keys += MOE_ARCHITECTURE_KEYS + MOE_ROUTING_KEYS
    return {k: getattr(model_cfg, k) for k in keys if hasattr(model_cfg, k)}


def routing_changes(manifest: dict, model_cfg) -> list[str]:
    """The routing settings this run changes from the checkpoint's, as 'key: a -> b'."""
    saved, here = manifest.get("model", {}), model_fields(model_cfg)
    return [f"{k}: {saved[k]!r} -> {here[k]!r}" for k in MOE_ROUTING_KEYS
            if k in saved and k in here and saved[k] != here[k]]


# Widths a config may leave unset (None: a rule on the other settings gives them),
# compared as the widths they resolve to: unset and the same width written out build
# the same weights.
RESOLVED_WIDTHS = {"ffn_dim": "ffn_hidden", "expert_ffn_dim": "expert_hidden"}


def _resolved_widths(fields: dict, model_cfg) -> dict:
    """The widths `fields` (a manifest's model settings) resolve to, read off `model_cfg`
    with those settings laid over it; {} where they do not make a valid config."""
    if not dataclasses.is_dataclass(model_cfg):
        return {}
    names = {f.name for f in dataclasses.fields(model_cfg)}
    try:
        cfg = dataclasses.replace(model_cfg, **{k: v for k, v in fields.items()
                                                if k in names})
        return {k: getattr(cfg, prop) for k, prop in RESOLVED_WIDTHS.items()
                if hasattr(cfg, prop)}
    except (PartitaError, TypeError, ValueError):
        return {}


def check_model(manifest: dict, model_cfg, folder: Path) -> None:
    """Refuse a checkpoint of another model, naming the settings that differ."""
    saved, here = manifest.get("model", {}), model_fields(model_cfg)
    # Widths are compared resolved; where the saved settings do not resolve, as written.
    widths_saved = _resolved_widths(saved, model_cfg)
    widths_here = _resolved_widths(here, model_cfg) if widths_saved else {}
    shown_saved, shown_here = dict(saved, **widths_saved), dict(here, **widths_here)
    # Keys a checkpoint lacks (written before it recorded them) are not compared; a
    # dense checkpoint records n_experts=0, so a dense/MoE mismatch is always caught.
    diff = [f"{k}: checkpoint {shown_saved[k]!r}, this run {shown_here[k]!r}" for k in here
            if k in saved and shown_saved[k] != shown_here[k]
            and k not in MOE_ROUTING_KEYS and k != "vocab_multiple"]
    padding = _vocab_padding(saved, here)
    if padding and not diff:  # only the padding differs: name the setting that fixes it
        raise CheckpointMismatch(
            f"checkpoint '{folder}' was written for another model ({padding}). Resume "
            f"with --model.vocab_multiple={saved.get('vocab_multiple', 1)}, or start a "
            "fresh run."
        )
    if diff:
        raise CheckpointMismatch(
            f"checkpoint '{folder}' was written for another model "
            f"({'; '.join(diff + ([padding] if padding else []))}). Resume with the model "
            "settings it was written with (its manifest.json lists them), or start a "
            "fresh run."
        )


def _vocab_padding(saved: dict, here: dict) -> str:
    """What differs when the checkpoint's padded vocabulary (vocab_size rounded up to a
    multiple of vocab_multiple: the rows of its embedding and head) is not this run's;
    "" when they agree. Settings that pad to the same rows build the same weights. A
    checkpoint that records no vocab_multiple was written before partita padded: 1."""
    if "vocab_size" not in saved or "vocab_size" not in here:
        return ""
    mult = [f.get("vocab_multiple", 1) for f in (saved, here)]
    rows = [padded_vocab(f["vocab_size"], m) for f, m in zip((saved, here), mult)]
    if rows[0] == rows[1]:
        return ""
    return (f"padded vocabulary: checkpoint {rows[0]:,} rows (vocab_multiple={mult[0]}), "
            f"this run {rows[1]:,} (vocab_multiple={mult[1]})")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def manifest_checksum(manifest: dict) -> int:
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(folder: Path, manifest: dict) -> None:
    """Write the manifest durably (a temporary name, fsync, rename, fsync the folder)."""
    manifest = dict(manifest, crc32=manifest_checksum(manifest))
    tmp = folder / (MANIFEST + PARTIAL)
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    fsync_dir(folder)


def read_manifest(folder: Path) -> dict:
    """The checkpoint's manifest, checked; CheckpointFileError saying what is wrong."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise CheckpointFileError(
            f"checkpoint '{folder}' does not exist or is not a folder; give the folder of a "
            "checkpoint (OUT_DIR/checkpoints/step-N), a run's out_dir, or train.resume=auto."
        )
    if not path.is_file():
        raise CheckpointFileError(
            f"'{folder}' holds no {MANIFEST}, so it is not a complete checkpoint (a save "
            "that did not finish, or not a checkpoint at all); resume from another one."
        )
    try:
        manifest = json.loads(path.read_text())
        ok = isinstance(manifest, dict) and manifest.get("crc32") == manifest_checksum(manifest)
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise CheckpointFileError(
            f"the manifest '{path}' is corrupt (it does not parse or does not match its "
            "checksum); resume from another checkpoint or copy the folder again."
        )
    if manifest.get("format") != FORMAT:
        raise CheckpointFileError(f"'{path}' is not a partita checkpoint manifest.")
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointFileError(
            f"the manifest '{path}' gives step {step!r}, not a step count (0 or more); it "
            "was edited, or written by something else. Resume from another checkpoint.")
    if int(manifest.get("version", 0)) > VERSION:
        raise CheckpointFileError(
            f"checkpoint '{folder}' has format version {manifest['version']}, written by "
            f"partita {manifest.get('partita_version', '?')}; this partita reads versions "
            f"up to {VERSION}. Upgrade partita to load it."
        )
    return manifest


def file_problem(folder: Path, manifest: dict) -> str:
    """'' when every file the manifest lists is there with its size, else what is not."""
    for f in manifest["files"]:
        path = folder / f["name"]
        if not path.is_file():
            return f"checkpoint file '{path}' is missing; the checkpoint is incomplete."
        if path.stat().st_size != f["size"]:
            return (f"checkpoint file '{path}' has {path.stat().st_size:,} bytes but its "
                    f"manifest says {f['size']:,}: it is truncated or was replaced.")
    return ""


def check_files(folder: Path, manifest: dict) -> None:
    """Every file the manifest lists is there with its size (cheap: no data is read;
    the checksums are checked as the data is read)."""
    problem = file_problem(folder, manifest)
    if problem:
        raise CheckpointFileError(f"{problem} Resume from {_another(folder)}, or copy the "
                                  "file again.")


def _another(folder: Path) -> str:
    """How to name the checkpoint to resume from instead of `folder`: the newest other
    one beside it whose manifest and files check out, else any (train.resume=PATH)."""
    for other in reversed(complete_checkpoints(folder.parent)):
        if other.name == folder.name:
            continue
        try:
            if not file_problem(other, read_manifest(other)):
                return f"{other.name}, the newest whole one (train.resume={other})"
        except CheckpointFileError:
            continue
    return "another checkpoint (train.resume=PATH)"


def is_checkpoint(folder: Path) -> bool:
    try:
        read_manifest(folder)
        return True
    except CheckpointFileError:
        return False


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`: the one `latest` names when it is
    sound, else the newest folder whose manifest checks out; None when there is none."""
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if STEP_DIR.match(named.name) and is_checkpoint(named):
            newer = [p for p in complete_checkpoints(root) if p.name > named.name]
            if not newer:
                return named
    for folder in reversed(complete_checkpoints(root)):
        if is_checkpoint(folder):
            return folder
    return None


def skipped_newer(chosen: Path) -> str:
    """'' or a note naming the checkpoints newer than `chosen`, in its folder, whose
    manifest exists but cannot be read (a damaged save that `find_latest` passed over),
    so that falling back to an older step is never silent."""
    step = STEP_DIR.match(chosen.name)
    if step is None:
        return ""
    skipped = [p.name for p in complete_checkpoints(chosen.parent)
               if int(STEP_DIR.match(p.name).group(1)) > int(step.group(1))
               and not is_checkpoint(p)]
    if not skipped:
        return ""
    return (f"partita: note: {', '.join(skipped)} in {chosen.parent} cannot be read (its "
            f"manifest is damaged); using {chosen.name}, the newest sound checkpoint.")


def all_damaged(root: Path, subject: str) -> NoSoundCheckpoint | None:
    """None, or the error to give when `root` holds checkpoints but `find_latest` found
    no sound one: every manifest there is damaged. Named as such, with the newest's
    reason, instead of as a folder without checkpoints."""
    found = complete_checkpoints(root)
    if not found or find_latest(root) is not None:
        return None
    try:
        read_manifest(found[-1])
        reason = "it cannot be read"
    except CheckpointFileError as exc:
        reason = str(exc).split(";")[0]  # its advice assumes another checkpoint
    names = ", ".join(p.name for p in found)
    return NoSoundCheckpoint(
        f"{subject}: every checkpoint in {root} has a damaged manifest ({names}), so there "
        f"is none to load. The newest: {reason}. Restore the folder from a copy; a new run "
        "there needs --train.overwrite=true, which deletes them.")


RESUME = "train.resume"


def resolve(path: Path, given_as: str = RESUME) -> Path:
    """What `train.resume=PATH` means: a checkpoint folder itself, or a folder of
    checkpoints (its newest), or a run's out_dir (the newest in its checkpoints/).
    `given_as` names the setting the path came from, for the messages ("" for an
    argument of `partita checkpoint`)."""
    if (path / MANIFEST).exists() or STEP_DIR.match(path.name):
        return path
    for root in (path, path / "checkpoints"):
        latest = find_latest(root)
        if latest is not None:
            return latest
    subject = f"{given_as}='{path}'" if given_as else f"'{path}'"
    for root in (path, path / "checkpoints"):
        if (damaged := all_damaged(root, subject)) is not None:
            raise damaged
    choices = "a checkpoint folder, a folder of checkpoints or a run's out_dir"
    if not path.exists():
        auto = (f", or {RESUME}=auto (the newest in this run's checkpoint folder)"
                if given_as == RESUME else "")
        raise CheckpointFileError(f"{subject} does not exist; give {choices}{auto}.")
    instead = f", or start without {RESUME}" if given_as == RESUME else ""
    # A run's out_dir whose run saved none (a finished run removes its empty
    # checkpoints/ folder, and leaves its weights).
    if (path / "checkpoints").is_dir() or (path / "model.safetensors").is_file():
        fresh = f" Start without {RESUME} to train from scratch." if given_as == RESUME else ""
        raise CheckpointFileError(
            f"{subject} is a run folder whose run saved no checkpoint: it has no "
            f"checkpoints/step-N folder with a {MANIFEST}. A run saves one every N "
            "steps with train.checkpoint_every=N, and when stopped by SIGTERM or "
            "train.stop_after; a run that finished without one left only its final "
            f"weights, {path / 'model.safetensors'}.{fresh}")
    raise CheckpointFileError(
        f"{subject} holds no complete checkpoint (no step-N folder with a "
        f"{MANIFEST}); give {choices}{instead}."
    )


def write_latest(root: Path, name: str) -> None:
    tmp = root / (LATEST + PARTIAL)
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def prune(root: Path, keep_last: int, protect: Path | None) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (0: keep all), never
    `protect` (the one this run resumed from). Returns what was deleted."""
    if keep_last <= 0:
        return []
    done = complete_checkpoints(root)
    keep = set(done[-keep_last:])
    kept = protect.resolve() if protect is not None else None
    gone = []
    for folder in done:
        if folder in keep or folder.resolve() == kept:
            continue
        # Drop the manifest first: a deletion cut short never leaves a folder that
        # still looks complete but lacks files.
        (folder / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        gone.append(folder)
    return gone


def remove_partials(root: Path) -> None:
    """Remove the folders of saves that never finished (a crash, a full disk)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.endswith(PARTIAL):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
