"""`partita checkpoint info|verify|export DIR`: look into, check and convert checkpoints.

DIR is a checkpoint folder (OUT_DIR/checkpoints/step-N), a folder of checkpoints, or a
run's out_dir (then its newest checkpoint); a folder of checkpoints' `latest` file, the
pointer to its newest, stands for that folder.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("checkpoint", help="inspect, verify or export a checkpoint")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = sub.add_parser("info", help="layout, step, sizes and tensors of a checkpoint")
    info.add_argument("dir", help="checkpoint folder, folder of checkpoints, or a run's out_dir")
    info.add_argument("--tensors", action="store_true", help="list every tensor")
    info.set_defaults(func=run_info)
    verify = sub.add_parser("verify", help="read every byte and check every checksum")
    verify.add_argument("dir")
    verify.set_defaults(func=run_verify, imports_torch=True)
    export = sub.add_parser("export", help="write full, unsharded weights (safetensors)")
    export.add_argument("dir")
    export.add_argument("--out", required=True, help="the .safetensors file to write")
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    export.set_defaults(func=run_export, imports_torch=True)


def _folder(text: str) -> Path:
    from partita.checkpoint import resolve
    from partita.checkpoint.manifest import LATEST, CheckpointFileError, skipped_newer

    given = Path(text)
    pointer = None
    if given.is_file():
        if given.name != LATEST:
            raise CheckpointFileError(
                f"'{given}' is a file; give a checkpoint folder (OUT_DIR/checkpoints/step-N), "
                "a folder of checkpoints or a run's out_dir.")
        # The pointer to the newest checkpoint of its folder: that checkpoint, found as a
        # resume finds it (the pointer, unless a newer sound one is beside it).
        pointer = given.read_text(errors="replace").strip()
        given = given.parent
    folder = resolve(given, given_as="")
    if pointer is not None and pointer != folder.name:
        print(f"partita: note: {text} names {pointer or 'nothing'}, which is not the newest "
              f"sound checkpoint beside it; showing {folder.name}, the one a resume takes.",
              file=sys.stderr, flush=True)
    if folder != given and (note := skipped_newer(folder)):  # the newest was chosen
        print(note, file=sys.stderr, flush=True)
    return folder


def _max_seq_len(manifest: dict) -> int | None:
    """The longest sequence the run's model took, from the run configuration the
    manifest records (the architecture fields leave it out: it shapes no weight)."""
    from partita.config import config_from_toml
    from partita.errors import PartitaError

    if not manifest.get("config"):
        return None
    try:
        cfg = config_from_toml(manifest["config"])
    except PartitaError:
        return None
    try:
        return cfg.model_config().max_seq_len
    except (PartitaError, OSError):  # an imported model's folder since moved
        return cfg.model.max_seq_len


def run_info(args: argparse.Namespace) -> int:
    from partita.checkpoint import read_manifest
    from partita.checkpoint.manifest import file_problem

    folder = _folder(args.dir)
    m = read_manifest(folder)
    sizes = {f["name"]: f["size"] for f in m["files"]}
    layout = m.get("layout", {})
    degrees = " ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if k in layout)
    # A pipeline schedule means nothing without a pipeline: shown where pp > 1.
    shown = ("zero_stage", "schedule", "virtual_stages", "sequence_parallel") \
        if layout.get("pp", 1) > 1 else ("zero_stage", "sequence_parallel")
    policies = ", ".join(f"{k}={layout[k]}" for k in shown if k in layout)
    if layout.get("moe_tp", "replicate") != "replicate":
        policies += f", moe_tp={layout['moe_tp']}"
    count = {}
    for p in m["pieces"]:
        count[p["name"]] = count.get(p["name"], 0) + 1
    params = sum(_numel(t["shape"]) for t in m["tensors"].values())
    print(f"checkpoint {folder}")
    print(f"  step {m['step']} (optimizer steps {m['optimizer']['steps']}), written "
          f"{m.get('created', '?')} by partita {m.get('partita_version', '?')}, torch "
          f"{m.get('torch_version', '?')}, format version {m['version']}")
    if run_id := m.get("training", {}).get("run_id"):  # OUT_DIR/run-id of its results
        print(f"  run {run_id}")
    print(f"  layout: {m['world_size']} process(es), {degrees}" + (f"; {policies}" if policies
                                                                    else ""))
    model = dict(m["model"])
    if "max_seq_len" not in model and (seq := _max_seq_len(m)) is not None:
        model["max_seq_len"] = seq
    print(f"  model: {', '.join(f'{k}={v}' for k, v in model.items())}")
    opt = m["optimizer"]
    if "betas" in opt:  # what a resume with other train.beta1/beta2/eps/weight_decay changes
        betas = ", ".join(f"{b:g}" for b in opt["betas"])
        print(f"  optimizer: {opt.get('name', 'adamw')}, betas {betas}, eps {opt['eps']:g}, "
              f"weight_decay {opt['weight_decay']:g}")
    dtypes = {k: v.removeprefix("torch.") for k, v in m["precision"].items()}
    print(f"  precision: parameters {dtypes['param_dtype']}, master and moments "
          f"{dtypes['master_dtype']}")
    print(f"  {len(m['tensors'])} tensors, {params:,} parameters; {len(sizes)} files, "
          f"{sum(sizes.values()) / 2**20:,.1f} MiB")
    for name, size in sizes.items():
        path = folder / name
        disk = path.stat().st_size if path.is_file() else None
        actual = ("" if disk == size else "  (missing)" if disk is None
                  else f"  (on disk: {disk / 2**20:,.2f} MiB)")
        print(f"    {name}  {size / 2**20:,.2f} MiB{actual}")
    if problem := file_problem(folder, m):  # the sizes above are the manifest's
        print(f"partita: warning: {problem} `partita checkpoint verify` checks every file.",
              file=sys.stderr, flush=True)
    if args.tensors:
        for name, t in m["tensors"].items():
            print(f"    {name}  {list(t['shape'])}  in {count.get(name, 0)} piece(s)")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from partita.checkpoint import read_manifest
    from partita.checkpoint.files import FileReader, record_from_json

    folder = _folder(args.dir)
    total = 0
    for f in read_manifest(folder)["files"]:
        reader = FileReader(folder / f["name"], record_from_json(f))
        reader.verify_all()
        reader.close()
        total += f["size"]
    print(f"{folder}: every checksum matches ({total / 2**20:,.1f} MiB read)")
    return 0


def run_export(args: argparse.Namespace) -> int:
    import torch

    from partita.checkpoint.export import full_tensors
    from partita.checkpoint.files import write_file
    from partita.errors import PartitaError
    from partita.run_dir import PARTIAL_SUFFIX

    folder = _folder(args.dir)
    out = Path(args.out)
    if out.is_dir():
        raise PartitaError(f"--out {out} is a folder; give the .safetensors file to write, "
                           f"e.g. {out / 'model.safetensors'}.")
    if out.exists() and not args.overwrite:  # as `partita export` does
        raise PartitaError(f"--out {out} already exists; add --overwrite to replace it, or "
                           "choose another file.")
    state = {}
    for name, t in full_tensors(folder):
        # As the end of a run writes its weights: float32, or float64 when trained so.
        state[name] = t.to(torch.float32) if t.dtype not in (torch.float64,) else t
    tmp = out.with_name(out.name + PARTIAL_SUFFIX)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        write_file(tmp, state, {"format": "partita", "model": "transformer"})
        os.replace(tmp, out)
    except OSError as exc:
        raise PartitaError(f"writing '{out}' failed ({exc.strerror or exc}); nothing was left "
                           "behind. Check that the folder can be written and has free "
                           "space, or choose another --out.") from None
    finally:
        # On a read-only folder even removing a file that is not there fails, and that
        # error would hide the one above.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    print(f"wrote {out}: {len(state)} tensors, "
          f"{sum(t.numel() for t in state.values()):,} parameters from {folder}")
    return 0


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
