"""Write a model in the Hugging Face format: config.json, sharded safetensors with
`model.safetensors.index.json`, and the tokenizer files when the run used one.

    export_hf(state, model_cfg, "out/hf", tokenizer="path/to/tokenizer.json")

`state` is a full state dict under partita's names (a run's model.safetensors, or
whatever a checkpoint reader assembles), so any source of full weights plugs in here.
`transformers.AutoModelForCausalLM.from_pretrained(out)` then loads it as a
LlamaForCausalLM with no missing or unexpected keys. The folder is written beside its
destination under a temporary name and renamed into place when complete, so a failed
export never leaves a half-written model, nor touches an existing one. `overwrite`
replaces only an earlier export (a folder holding nothing but what an export writes),
never a run's folder, a checkpoint or any other folder.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch

from partita.errors import PartitaError
from partita.models.hf_config import check_exportable, hf_config_from_model
from partita.models.hf_weights import to_hf_state
from partita.models.model_config import ModelConfig

FORMATS = ("hf",)
DEFAULT_SHARD_BYTES = 2 << 30
INDEX = "model.safetensors.index.json"
# The tokenizer files transformers and other tools read, copied when present (a chat
# template lives in its own file since transformers 4.43).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")
# Copied from the imported model's folder (model.init_from): its sampling defaults and
# list of end ids, which chat models rely on.
GENERATION_CONFIG = "generation_config.json"
# What an export writes, and so all that a folder `overwrite` may replace holds.
EXPORT_FILES = frozenset({INDEX, "config.json", GENERATION_CONFIG, *TOKENIZER_FILES})
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def shard_names(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into files of at most `max_bytes` (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def tokenizer_files(tokenizer: str | Path | None) -> list[Path]:
    """The tokenizer files to copy: a tokenizer.json itself, or the known files of a folder."""
    if not tokenizer:
        return []
    path = Path(tokenizer)
    if path.is_file():
        siblings = [path.parent / n for n in TOKENIZER_FILES[1:] if (path.parent / n).is_file()]
        return [path, *siblings]
    return [path / n for n in TOKENIZER_FILES if (path / n).is_file()]


def export_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out: str | Path,
              tokenizer: str | Path | None = None, dtype: torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
              bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None,
              pad_token_id: int | None = None, also_copy: tuple[Path, ...] = ()) -> Path:
    """Write `state` (full weights, partita names) of model `cfg` as a Hugging Face
    Llama folder at `out`; returns `out`. `dtype`: cast the floating tensors (None: keep).
    `also_copy`: more files for the folder (the source model's generation config)."""
    from partita.checkpoint.files import write_file

    check_exportable(cfg)  # first: what no weights can fix
    copies = [*tokenizer_files(tokenizer), *also_copy]
    out = check_out(out, overwrite, {p.name for p in copies})
    hf_state = to_hf_state(state, cfg)
    if dtype is not None:
        hf_state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in hf_state.items()}
    first = next(iter(hf_state.values()))
    dtype_name = str(first.dtype).removeprefix("torch.")
    groups = shard_names(hf_state, max_shard_bytes)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        weight_map, total = {}, 0
        for i, names in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            # The same writer as the run's weights (`weights.save_weights` says why);
            # transformers reads files whose metadata says "pt".
            write_file(tmp / file, {n: hf_state[n].contiguous() for n in names},
                       {"format": "pt"})
            weight_map.update({n: file for n in names})
            total += sum(hf_state[n].numel() * hf_state[n].element_size() for n in names)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = hf_config_from_model(cfg, dtype_name, bos_token_id, eos_token_id,
                                      pad_token_id)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for path in copies:
            shutil.copyfile(path, tmp / path.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            advice = (f"The folder '{out.parent}' cannot be written: choose an --out in a "
                      "folder you can write to.")
        elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
            advice = "Free disk space or choose another --out folder."
        else:
            advice = "Choose another --out folder."
        raise PartitaError(f"writing the export to '{out}' failed ({exc.strerror or exc}); "
                           f"nothing was left behind. {advice}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_out(out: str | Path, overwrite: bool, copies: set[str] | frozenset[str] = frozenset()
              ) -> Path:
    """`out` as a Path, once it is known that the export may be written there: not empty
    text (which Path reads as '.'), not a file, and missing, empty or, with `overwrite`,
    an earlier export: an index and nothing but what an export writes (`copies`: the
    names of the files this one copies in, a tokenizer file of another name). Anything
    else with files in it (a run's folder, a checkpoint, a folder of one's own) is
    refused with what it holds, and left alone."""
    out = _given(out)
    if out.exists() and not out.is_dir():
        raise PartitaError(f"--out '{out}' is a file, not a folder; give the folder to write "
                           "the export to.")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    if not entries:
        return out
    if not overwrite:
        raise PartitaError(f"'{out}' already exists and is not empty; choose another --out "
                           "folder, or pass --overwrite to replace it (an earlier export "
                           "only).")
    names = {p.name for p in entries}
    if INDEX in names and all(n in EXPORT_FILES or n in copies or SHARD.fullmatch(n)
                              for n in names):
        return out
    from partita.checkpoint.manifest import LATEST, MANIFEST, STEP_DIR

    if "config.toml" in names or "checkpoints" in names or "model.safetensors" in names:
        what = "looks like a run's folder"
    elif MANIFEST in names or STEP_DIR.match(out.name):
        what = "is a checkpoint"
    elif LATEST in names or any(STEP_DIR.match(n) for n in names):
        what = "is a folder of checkpoints"
    elif INDEX in names:
        what = "is an export with files an export does not write"
    else:
        what = f"is not an earlier export (it has no {INDEX})"
    shown = [p.name + "/" * p.is_dir() for p in entries[:6]]
    more = f" and {len(entries) - 6} more" if len(entries) > 6 else ""
    raise PartitaError(f"--out '{out}' {what}: it holds {', '.join(shown)}{more}. "
                       "--overwrite replaces only an earlier export, so nothing was "
                       "touched; choose another --out folder, or move or delete what it "
                       "holds yourself if it is no longer needed.")


def _given(out: str | Path) -> Path:
    if not str(out).strip():
        raise PartitaError("--out is empty: give the folder to write the export to, e.g. "
                           "--out hf.")
    return Path(out)


def run_weights(run_dir: str | Path):
    """(full state dict under partita's names, the run's Config) of a finished run:
    RUN_DIR/model.safetensors, written at the end of `partita train`, and its config.toml.

    The one place export reads weights from; another source of full weights (a
    checkpoint assembled from its per-rank files) returns the same pair.
    """
    cfg, read = run_source(run_dir)
    return read(), cfg


def run_source(run_dir: str | Path):
    """(the run's Config, a function that reads its full weights): the config is read
    now, the weights only when asked, so a run that cannot be exported is refused before
    gigabytes are read (or a checkpoint's pieces assembled)."""
    from partita.config import config_from_toml, load_config
    from partita.weights import load_weights

    run = Path(run_dir)
    config, weights = run / "config.toml", run / "model.safetensors"
    if not weights.is_file():
        from partita.checkpoint import read_manifest, resolve
        from partita.checkpoint.export import full_tensors
        from partita.checkpoint.manifest import NoSoundCheckpoint

        try:
            folder = resolve(run, given_as="")
        except NoSoundCheckpoint:
            raise  # say so, rather than that the folder is no run
        except PartitaError:
            folder = None
        if folder is not None:  # a checkpoint: assembled from its per-rank files
            manifest = read_manifest(folder)

            def assemble() -> dict[str, torch.Tensor]:
                return {name: t if t.dtype == torch.float64 else t.to(torch.float32)
                        for name, t in full_tensors(folder)}

            return config_from_toml(manifest["config"]), assemble
    for path in (config, weights):
        if not path.is_file():
            raise PartitaError(f"'{path}' does not exist: '{run}' is neither a finished "
                               "run's folder (train.out_dir of a run that completed) nor a "
                               "checkpoint.")
    return load_config(config), lambda: load_weights(weights)


def _generation_config(init_from: str) -> Path | None:
    """The imported model's generation_config.json, None where it has none."""
    from partita.models.hf_config import config_path

    path = config_path(init_from).parent / GENERATION_CONFIG
    return path if path.is_file() else None


def check_not_over_source(source: Path, out: Path) -> None:
    """Refuse an export folder that would replace what it is exported from: `--out` the
    run itself, a folder holding it, or one of its own folders (its checkpoints/) that
    is not an earlier export. With --overwrite the folder is replaced whole, and the
    run was deleted."""
    src, dst = source.resolve(), out.resolve()
    holds_source = dst == src or dst in src.parents
    inside_not_an_export = (src in dst.parents and dst.exists()
                            and not (dst / INDEX).is_file())
    if holds_source or inside_not_an_export:
        what = "is the run's own folder or holds it" if holds_source else \
            "is a folder of the run that is not an earlier export"
        raise PartitaError(f"--out '{out}' {what}; the export would replace what it is "
                           f"read from. Choose another --out, such as '{source / 'hf'}'.")


def export_run(run_dir: str | Path, out: str | Path, fmt: str = "hf",
               overwrite: bool = False, dtype: torch.dtype | None = None) -> Path:
    """Export a finished run's weights with the model shape and tokenizer of its config."""
    if fmt not in FORMATS:
        raise PartitaError(f"export format '{fmt}' is unknown; use one of {', '.join(FORMATS)}.")
    check_not_over_source(Path(run_dir), _given(out))
    cfg, read = run_source(run_dir)
    # First: a model with no Llama form is named as such before any weight is read (and
    # not blamed on the weights when their names are compared).
    check_exportable(cfg.model_config())
    tokenizer = cfg.data.tokenizer or None
    generation = _generation_config(cfg.model.init_from) if cfg.model.init_from else None
    check_out(out, overwrite, {p.name for p in tokenizer_files(tokenizer)}
              | ({generation.name} if generation else set()))  # before any weight is read
    state = read()
    bos = eos = pad = None
    also_copy = (generation,) if generation is not None else ()
    if cfg.model.init_from:
        from partita.models.hf_config import read_hf_config

        source = read_hf_config(cfg.model.init_from)
        bos, eos, pad = (source.get(k) for k in ("bos_token_id", "eos_token_id",
                                                 "pad_token_id"))
    if tokenizer is not None:
        from partita.data.hf_tokenizer import special_token_ids

        # A source's list of end ids (chat models stop at any of them) is kept when
        # the tokenizer's own EOS is among them.
        ends = eos if isinstance(eos, list) else None
        bos, eos = special_token_ids(tokenizer, bos, None if ends else eos)
        if ends is not None and (eos is None or eos in ends):
            eos = ends
    return export_hf(state, cfg.model_config(), out, tokenizer=tokenizer, dtype=dtype,
                     overwrite=overwrite, bos_token_id=bos, eos_token_id=eos,
                     pad_token_id=pad, also_copy=also_copy)
