"""`partita plan`: the best layouts for a model on a cluster, or one layout explained."""

from __future__ import annotations

import argparse

from partita.errors import PartitaError, require_in_range


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="predict memory and step time of parallel layouts and rank them",
        description=(
            "Enumerate every layout partita can train (dp x tp x pp, ZeRO stage, schedule "
            "and virtual stages, microbatch size) for a model on a cluster, explain each "
            "GPU's memory byte by byte, predict step time, and rank the layouts that fit. "
            "Needs only model shapes and a hardware description."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True,
                   help="catalog name (e.g. llama3-70b) or a TOML file with a [model] table")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu-type", default="H100",
                   help="A100-40GB, A100-80GB, H100, H200, B200, cpu (measures this machine), "
                        "or a name from --hardware")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="default: the GPU type's node size (8 for DGX/HGX)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step; default: about 4M tokens")
    p.add_argument("--layout", default=None,
                   help='evaluate one layout, e.g. "dp=8 tp=2 pp=2 zero_stage=1 '
                        'microbatch_size=1"')
    p.add_argument("--all-options", action="store_true",
                   help="also search context and expert parallelism and "
                        "offload, which are modelled but not available yet in partita "
                        "train (shown as rejected, never ranked)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--hardware", default=None,
                   help="TOML file of [gpu.NAME] profiles (fields of GPUSpec)")
    p.add_argument("--implementation", default=None, choices=("fused", "partita"),
                   help="what the activations and loss describe: fused (Megatron-style "
                        "fused GPU kernels; default on GPUs) or partita (partita's own "
                        "eager model, as measured; default for cpu)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a modelling assumption (repeatable), "
                        "e.g. --set compute_efficiency=0.45")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="draw the memory breakdown of the top layouts (needs matplotlib)")
    p.set_defaults(func=run)


MAX_GPUS = 1 << 17  # 131,072: beyond the largest clusters; a search there takes seconds


def run(args: argparse.Namespace) -> int:
    from partita.layout import parse_layout
    from partita.planner import report
    from partita.planner.advice import advise_layout, advise_search
    from partita.planner.api import make_request
    from partita.planner.assumptions import Assumptions
    from partita.planner.evaluate import evaluate
    from partita.planner.search import DEFAULT_SPACE, SearchSpace, search

    require_in_range("--gpus", args.gpus, 1, MAX_GPUS, "larger searches run for minutes")
    require_in_range("--gpus-per-node", args.gpus_per_node, 1, 1024)
    require_in_range("--seq-len", args.seq_len, 2, 1 << 22)
    require_in_range("--global-batch", args.global_batch, 1, 1 << 24, "sequences per step")
    require_in_range("--top", args.top, 1, 10_000)
    settings = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise PartitaError(f"--set {item}: write NAME=VALUE.")
        settings[name.strip()] = value.strip()
    if args.implementation == "partita":
        base = Assumptions.measured_cpu()
    elif args.implementation == "fused":
        base = Assumptions()
    else:
        base = Assumptions.for_device(args.gpu_type)
    req = make_request(args.model, args.gpus, args.gpu_type, args.gpus_per_node,
                       args.seq_len, args.global_batch, args.precision,
                       base.override(settings), args.hardware)
    if args.layout is not None:
        ev = evaluate(req, parse_layout(args.layout, args.gpus))
        advice = advise_layout(req, ev)
        if args.json:
            print(report.to_json(req, ev=ev, advice=advice))
        else:
            print(report.format_evaluation(req, ev))
            _print_advice(advice)
        if args.png and ev.memory:
            report.draw_memory([ev], args.png)
        return 0 if ev.fits else 1
    space = SearchSpace.everything() if args.all_options else DEFAULT_SPACE
    result = search(req, space)
    advice = advise_search(req) if not result.ranked else []
    if args.json:
        print(report.to_json(req, result=result, top=args.top, advice=advice))
    else:
        print(report.format_search(result, args.top))
        _print_advice(advice, nothing_fits=not result.ranked)
    if args.png and result.ranked:
        report.draw_memory(result.ranked[:args.top], args.png)
    return 0 if result.ranked else 1


def _print_advice(advice: list[str], nothing_fits: bool = False) -> None:
    if advice:
        print("Smallest change that would fit: " + advice[0])
        for line in advice[1:]:
            print("  or " + line)
    elif nothing_fits:
        print("No single change among the ZeRO stage, a smaller microbatch, a shorter "
              "sequence, up to 64x the GPUs or a larger GPU makes a layout fit.")
