"""`partita export RUN_OR_CHECKPOINT --format hf --out DIR`: a run's weights for other
tools, from a finished run's folder or from a checkpoint written at any layout."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export", help="write a finished run's weights in another format (hf: transformers)")
    p.add_argument("run", help="a finished run's out_dir (config.toml, model.safetensors), or "
                               "a checkpoint folder, folder of checkpoints or out_dir of a run "
                               "that stopped (its newest checkpoint)")
    p.add_argument("--format", default="hf", choices=("hf",),
                   help="hf: a Hugging Face Llama folder (config.json, sharded safetensors)")
    p.add_argument("--out", required=True, help="the folder to write (missing or empty; "
                   "--overwrite replaces an earlier export, never a run, a checkpoint or "
                   "another folder)")
    p.add_argument("--dtype", default="", help="cast the weights (float32, bfloat16, ...)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out when it holds an earlier export")
    p.set_defaults(func=run, imports_torch=True)


def run(args: argparse.Namespace) -> int:
    from partita.export import export_run
    from partita.parallelize import parse_dtype

    dtype = parse_dtype(args.dtype, "--dtype") if args.dtype else None
    out = export_run(args.run, args.out, args.format, args.overwrite, dtype)
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0
