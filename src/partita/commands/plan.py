"""`partita plan`: the best layouts for a model on a cluster, or one layout explained."""

from __future__ import annotations

import argparse

from partita.commands import PICTURE_FORMATS, check_output_file
from partita.errors import PartitaError, require_in_range
from partita.layout_rules import CONSTRAINT, DIVISIBILITY
from partita.planner.precision import NAMES as PRECISION_NAMES


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
    )
    p.add_argument("--model", default=None,
                   help="catalog name (e.g. llama3-70b), a TOML file with a [model] table, "
                   "or a Hugging Face model folder (its config.json)")
    p.add_argument("--model-shape", default=None, metavar="SHAPE",
                   help="a model given by its shape instead of --model, e.g. "
                        "layers=96,hidden=12288,heads=96,vocab=51200,seq=2048,flavour=gpt2 "
                        "(also kv_heads, ffn, dropout, tie, vocab_multiple)")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu-type", default=None,
                   help="A100-40GB, A100-80GB, H100, H200, B200, cpu (measures this machine), "
                        "or a name from --hardware; default: H100")
    p.add_argument("--remeasure", action="store_true",
                   help="with --gpu-type cpu: measure this machine again rather than use "
                        "the profile an earlier plan kept (for 24 h)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="default: the GPU type's node size (8 for DGX/HGX)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step; default: the power of two at or below 4M "
                        "tokens "
                        "(with --gpu-type cpu: partita train's, 16)")
    p.add_argument("--layout", default=None,
                   help='evaluate one layout, e.g. "dp=8 tp=2 pp=2 zero_stage=1 '
                        'microbatch_size=1"')
    p.add_argument("--fix", default=None, metavar="NAME=VALUE,...",
                   help="search only layouts with these values, e.g. tp=8,pp=8 or "
                        "zero_stage=1,microbatch_size=1 (any layout field)")
    p.add_argument("--all-options", action="store_true",
                   help="also search context parallelism and offload, which a default "
                        "search leaves out, and judge the options partita train does "
                        "not run yet (shown as rejected, never ranked)")
    p.add_argument("--precision", default=None, choices=PRECISION_NAMES,
                   help="default: bf16 (mixed, fp32 master weights); fp32 with "
                        "--gpu-type cpu; bf16-fp32-grads: gradients held and reduced in "
                        "fp32 (precision.reduce_dtype=float32, Megatron-LM's bf16)")
    p.add_argument("--hardware", default=None,
                   help="TOML file of [gpu.NAME] profiles (fields of GPUSpec)")
    p.add_argument("--implementation", default=None, choices=("fused", "partita"),
                   help="what the activations and loss describe: fused (Megatron-style "
                        "fused GPU kernels; default on GPUs) or partita (partita's own "
                        "eager model, as measured; default for cpu)")
    p.add_argument("--compile", default=None, choices=("none", "blocks", "model", "auto"),
                   help="train.compile to predict for (default none; model falls back to "
                   "blocks where a layout cannot be compiled whole)")
    p.add_argument("--keep-gathered", default=None, metavar="N|auto",
                   help="ZeRO-3 layouts: gather units kept from forward into backward "
                        "(parallel.keep_gathered; auto: the most that fit; default: the "
                        "implementation's, 1 for partita)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a modelling assumption (repeatable), "
                        "e.g. --set gemm_peak_fraction=0.6")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="draw the memory breakdown of the top layouts (needs matplotlib)")
    p.set_defaults(func=run)


# The names --layout takes for virtual_stages, and what partita train fills in for
# interleaved-1f1b without one (Config.layout).
VIRTUAL_STAGES_NAMES = {"virtual_stages", "vpp", "v"}
INTERLEAVED_DEFAULT_VIRTUAL_STAGES = 2

# Rejections that no amount of memory lifts: a layout breaking one cannot be trained.
RULES = (DIVISIBILITY, CONSTRAINT)
MAX_GPUS = 1 << 17  # 131,072: beyond the largest clusters; a search there takes seconds


def run(args: argparse.Namespace) -> int:
    from partita.layout import parse_layout
    from partita.planner import report
    from partita.planner.advice import advise_layout, advise_search
    from partita.planner.api import DEFAULT_BATCH_TOKENS, make_request
    from partita.planner.assumptions import Assumptions
    from partita.planner.evaluate import evaluate, layout_text
    from partita.planner.model_shape import parse_model_shape, resolve_model
    from partita.planner.search import (
        DEFAULT_SPACE,
        SearchSpace,
        default_sequence_parallel,
        search,
    )
    from partita.planner.search_refusals import every_layout_breaks_a_rule, no_layout_to_search

    require_in_range("--gpus", args.gpus, 1, MAX_GPUS, "larger searches run for minutes")
    require_in_range("--gpus-per-node", args.gpus_per_node, 1, 1024)
    require_in_range("--seq-len", args.seq_len, 2, 1 << 22)
    require_in_range("--global-batch", args.global_batch, 1, 1 << 24, "sequences per step")
    require_in_range("--top", args.top, 1, 10_000)
    if args.png is not None:  # an empty name too: it would silently draw nothing
        check_output_file(args.png, "--png", PICTURE_FORMATS)
    if (args.model is None) == (args.model_shape is None):
        raise PartitaError("give the model with --model NAME_OR_TOML or --model-shape "
                           "layers=...,hidden=...,heads=...,vocab=...,seq=... (one of them).")
    # An empty value (an unset shell variable) is given but names nothing.
    for flag, value, what in (("--model", args.model, "a catalog name (e.g. llama3-8b) "
                                                      "or a TOML file"),
                              ("--model-shape", args.model_shape, "the shape, e.g. layers=32,"
                               "hidden=4096,heads=32,vocab=32000,seq=4096"),
                              ("--layout", args.layout, 'a layout, e.g. "dp=8 tp=2 '
                               'zero_stage=1", or leave --layout out to search'),
                              ("--fix", args.fix, "NAME=VALUE pins, e.g. tp=8,pp=2, or "
                               "leave --fix out to search every layout")):
        if value is not None and not value.replace(",", " ").strip():  # "," names nothing
            raise PartitaError(f"{flag} is empty: give {what}.")
    settings = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise PartitaError(f"--set {item}: write NAME=VALUE.")
        name = name.strip()
        if name in settings:  # a later value would silently win, as in --fix and --layout
            raise PartitaError(f"--set gives {name} twice ({name}={settings[name]} and "
                               f"{item.strip()}); give each name once.")
        settings[name] = value.strip()
    if args.layout is not None and (args.fix or args.all_options):
        raise PartitaError(f"--layout evaluates one layout and --"
                           f"{'fix' if args.fix else 'all-options'} shapes a search: give "
                           "one of them (pinned values can go into --layout itself).")
    defaults: list[str] = []  # every setting filled in for the user, printed with the plan
    if args.gpu_type is None and args.hardware:
        # The file's GPU, not a catalog one the file does not describe.
        from partita.planner.hardware import load_gpu_profiles

        names = sorted(load_gpu_profiles(args.hardware))
        if len(names) != 1:
            raise PartitaError(f"--hardware {args.hardware} describes {len(names)} GPUs "
                               f"({', '.join(names) or 'none'}): name the one to plan for "
                               "with --gpu-type.")
        args.gpu_type = names[0]
        defaults.append(f"--gpu-type {names[0]} (the one in --hardware)")
    if args.gpu_type is None:
        args.gpu_type = "H100"
        defaults.append("--gpu-type H100")
    if args.remeasure and args.gpu_type.lower() != "cpu":
        raise PartitaError(f"--remeasure measures this machine for --gpu-type cpu; "
                           f"--gpu-type {args.gpu_type} is a catalog or --hardware profile, "
                           "which nothing measures.")
    if args.precision is None:  # what partita train uses there by default
        args.precision = "fp32" if args.gpu_type.lower() == "cpu" else "bf16"
        defaults.append(f"--precision {args.precision}")
    implementation = args.implementation or ("partita" if args.gpu_type.lower() == "cpu"
                                             else "fused")
    if args.implementation == "partita":
        base = (Assumptions.measured_cpu() if args.gpu_type.lower() == "cpu"
                else Assumptions.partita_on_gpu())
    elif args.implementation == "fused":
        base = Assumptions()
    else:
        base = Assumptions.for_device(args.gpu_type)
        defaults.append("--implementation " + ("partita" if args.gpu_type.lower() == "cpu"
                                               else "fused"))
    if args.compile is None:
        args.compile = "none"
        defaults.append("--compile none")
    keep = args.keep_gathered  # make_request refuses what is neither a count nor auto
    keep = int(keep) if keep is not None and keep.isdigit() else keep
    model = (parse_model_shape(args.model_shape) if args.model_shape is not None
             else resolve_model(args.model))
    if args.model_shape is not None and "dropout" not in _shape_names(args.model_shape):
        defaults.append(f"dropout={model.config.dropout:g} (--model-shape without dropout; "
                        "it sets the dropout masks' memory and time)")
    gpu = args.gpu_type
    if args.gpu_type.lower() == "cpu" and not args.hardware:
        from dataclasses import replace

        from partita.planner.cpu_profile import cached_local_cpu, local_bf16_units

        gpu, measured = cached_local_cpu(remeasure=args.remeasure)
        defaults.append(measured)
        # The model's "auto" attention follows this CPU's bf16 units.
        base = replace(base, cpu_bf16_units=local_bf16_units(gpu))
    cpu_batch = args.global_batch is None and args.gpu_type.lower() == "cpu"
    if cpu_batch:  # a plan for `partita train` here: its own batch, not ~4M tokens
        from partita.config import TrainSection

        args.global_batch = TrainSection().global_batch
    req = make_request(model, args.gpus, gpu, args.gpus_per_node,
                       args.seq_len, args.global_batch, args.precision,
                       base.override(settings), args.hardware, args.compile, keep)
    if isinstance(keep, int):  # at most every gather unit of the model
        from partita.layout import Layout
        from partita.planner.zero_buffers import zero3_buffers

        units = len(zero3_buffers(req.model, Layout(zero_stage=3), req.precision, 0,
                                  req.assumptions)["units"])
        if keep > units:
            raise PartitaError(f"--keep-gathered {keep}: {req.model.name} has {units} "
                               f"ZeRO-3 gather units; give at most {units}, or auto.")
    if keep is None and "zero3_kept_units" not in settings:
        defaults.append(f"--keep-gathered {req.assumptions.zero3_kept_units} (ZeRO-3 units "
                        "kept into backward, as the implementation does)")
    a = req.assumptions
    if not a.gemm_peak_fraction:  # the GPU family's figure: named where it has none
        defaults += _gemm_fraction_default(req.cluster.gpu)
    if (a.attention_kernel == "model" and req.model.config.attention == "auto"
            and req.precision.activation == 2):
        from partita.models.attention_kernel import explicit_scores_limit, uses_explicit_scores

        # Named where the model's own rule would take explicit scores at some size.
        if uses_explicit_scores("auto", a.device_type, "bfloat16", 0, a.cpu_bf16_units):
            defaults.append(f"model.attention auto (explicit bf16 scores while a call's "
                            f"number at most {explicit_scores_limit(a.cpu_bf16_units):,}, "
                            "as partita does on "
                            "this CPU; attention=sdpa in --model-shape or the model's table "
                            "for torch's fused kernel)")
    if args.seq_len is None:
        limit = ("attention window" if req.model.config.attention_window == req.seq_len
                 else "max_seq_len")
        defaults.append(f"--seq-len {req.seq_len} (the model's {limit})")
    if cpu_batch:
        defaults.append(f"--global-batch {req.global_batch} (partita train's default)")
    elif args.global_batch is None:
        defaults.append(f"--global-batch {req.global_batch} (the power of two at or below "
                        f"{DEFAULT_BATCH_TOKENS / 1e6:.1f} M tokens / --seq-len: "
                        f"{req.global_batch * req.seq_len / 1e6:.2f} M tokens)")
    if args.gpus_per_node is None:
        defaults.append(f"--gpus-per-node {req.cluster.gpus_per_node}")
    per_node = req.cluster.gpus_per_node
    if args.gpus > per_node and args.gpus % per_node:
        import sys

        print(f"partita: note: {args.gpus} GPUs do not fill whole nodes of {per_node} "
              f"({-(-args.gpus // per_node)} nodes, the last with {args.gpus % per_node}); "
              f"a group wider than {per_node} GPUs is modelled over the inter-node network. "
              "Set --gpus-per-node if that is not the machine.", file=sys.stderr)
    if args.layout is not None:
        layout = parse_layout(args.layout, args.gpus)
        given = _given_fields(args.layout)
        if not given & {"sequence_parallel", "sp"}:
            layout = layout.with_(sequence_parallel=default_sequence_parallel(layout.tp))
        if (layout.schedule == "interleaved-1f1b" and layout.pp > 1
                and not given & VIRTUAL_STAGES_NAMES):  # partita train's default for it
            layout = layout.with_(virtual_stages=INTERLEAVED_DEFAULT_VIRTUAL_STAGES)
        # A pipeline schedule other than the default would be dropped unseen at pp=1;
        # the default is what every layout carries (a plan's JSON degrees too).
        if "schedule" in given and layout.pp == 1 and layout.schedule != "1f1b":
            raise PartitaError(f"--layout {args.layout}: schedule={layout.schedule} is a "
                               "pipeline schedule, but pp=1 has no pipeline; set pp > 1 or "
                               "drop schedule=.")
        if keep is not None and layout.zero_stage != 3:
            raise PartitaError(f"--keep-gathered {args.keep_gathered} applies to ZeRO-3, "
                               f"which gathers parameters; this layout is zero_stage="
                               f"{layout.zero_stage}: drop --keep-gathered or set "
                               "zero_stage=3.")
        defaults += _layout_defaults(args.layout, layout, req.model.is_moe)
        ev = evaluate(req, layout)
        broken = [text for kind, text in ev.reasons if kind in RULES]
        if broken:  # not a layout partita can train: bad input, whatever its memory
            raise PartitaError(f"--layout {layout_text(layout)}: partita cannot train this "
                               f"layout on {args.gpus} GPUs, as it breaks "
                               f"{_count(len(broken), 'rule')}: "
                               f"{'; '.join(r.rstrip('.') for r in broken)}.")
        advice = advise_layout(req, ev)
        # The status is known before anything is printed: a reader that closes the pipe
        # early (`| head`) must not turn it into another (partita.cli).
        args.exit_status = 0 if ev.fits or args.json else 1
        if args.json:
            print(report.to_json(req, ev=ev, advice=advice, defaults=defaults,
                                 implementation=implementation))
        else:
            print(report.format_evaluation(req, ev))
            _print_advice(advice)
            _print_defaults(defaults)
        if args.png is not None:
            _draw(report, [ev], args.png, args.json, "")
        # --json: a plan was printed (its "fits" says whether it fits).
        return args.exit_status
    space = SearchSpace.everything() if args.all_options else DEFAULT_SPACE
    if args.fix:
        space = _pinned_space(space, _parse_fix(args.fix))
    if not any(k == "sequence_parallel" for k, _ in space.fixed):
        defaults.append("sequence_parallel on whenever tp > 1")
    pinned = dict(space.fixed)
    if (space.context_parallel or int(pinned.get("cp", 1)) > 1) and "cp_kind" not in pinned:
        defaults.append("cp_kind=ring (context-parallel attention, where cp > 1)")
    result = search(req, space)
    if result.searched == 0:
        raise PartitaError(no_layout_to_search(space.fixed, req))
    if not (result.ranked or result.modelled) and set(result.rejected) <= set(RULES):
        # Every layout breaks a rule (none merely lacks memory): the request, not the
        # cluster, is what must change.
        raise PartitaError(every_layout_breaks_a_rule(result, space.fixed, req))
    advice = advise_search(req, space) if not result.ranked else []
    args.exit_status = 0 if result.ranked or args.json else 1  # before printing (above)
    if args.json:
        print(report.to_json(req, result=result, top=args.top, advice=advice,
                             defaults=defaults, implementation=implementation))
    else:
        print(report.format_search(result, args.top))
        _print_advice(advice, nothing_fits=not result.ranked, fixed=space.fixed)
        _print_defaults(defaults)
    if args.png is not None:
        if result.ranked:
            _draw(report, result.ranked[:args.top], args.png, args.json, "")
        else:  # the closest misses, against the capacity line they cross
            closest = [e for e in result.examples.get("memory", []) if e.memory]
            _draw(report, closest, args.png, args.json, " (the closest layouts, none fits)")
    return args.exit_status


def _draw(report, evals: list, path: str, json_out: bool, what: str) -> None:
    """Draw `evals` into `path` and say so (on stderr under --json, whose stdout is the
    JSON alone), or say why nothing was drawn."""
    import sys

    stream = sys.stderr if json_out else sys.stdout
    if not evals:
        print(f"--png {path}: nothing drawn, as no layout has a memory breakdown.",
              file=stream)
        return
    report.draw_memory(evals, path)
    print(f"wrote {path}{what}", file=stream)


def _pinned_space(space, fixed: tuple[tuple[str, object], ...]):
    """`space` searching only the pinned values, including options it would leave out
    (a pinned recompute, cp or ep is searched even without --all-options)."""
    from dataclasses import replace

    pinned = dict(fixed)
    widen = {"recompute": "recompute", "offload": "offload", "schedule": "schedules",
             "zero_stage": "zero_stages"}
    changes: dict[str, object] = {widen[k]: (v,) for k, v in pinned.items() if k in widen}
    if "cp" in pinned or "cp_kind" in pinned:  # a cp_kind is a choice for cp > 1
        changes["context_parallel"] = True
    if "ep" in pinned:
        changes["expert_parallel"] = True
    if "virtual_stages" in pinned:
        changes["max_virtual_stages"] = pinned["virtual_stages"]
    if "microbatch_size" in pinned:
        changes["max_microbatch"] = pinned["microbatch_size"]
    return replace(space, fixed=fixed, **changes)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _parse_fix(text: str) -> tuple[tuple[str, object], ...]:
    """`tp=8,pp=8` -> (("tp", 8), ("pp", 8)), names and values read as `--layout` reads
    them."""
    from dataclasses import fields

    from partita.errors import pair_hint
    from partita.layout import DEGREES, RENAMED, Layout
    from partita.layout import _convert as convert

    known = [f.name for f in fields(Layout)]
    out: dict[str, object] = {}
    for item in text.replace(",", " ").split():
        key, sep, raw = item.partition("=")
        key = RENAMED.get(key.strip().lower(), key.strip().lower())
        if not sep or key not in known:
            raise PartitaError(f"--fix: cannot read '{item}'.{pair_hint(key, known)} "
                               f"Write NAME=VALUE pairs with names among {', '.join(known)}.")
        if key in out:  # a later value would silently win over the first
            raise PartitaError(f"--fix {text}: {key} is given twice ('{item}' and "
                               f"{key}={out[key]}); give each name once.")
        value = convert(key, raw.strip(), text)
        if key == "schedule":
            from partita.layout import canonical_schedule

            value = canonical_schedule(str(value))
        out[key] = value
    # Each value checked as a layout checks it (a recompute or schedule name, a stage,
    # a positive degree); whether the values go together is the search's question.
    Layout(**{k: v for k, v in out.items() if k not in DEGREES})
    for key in DEGREES:
        if key in out and int(out[key]) < 1:
            raise PartitaError(f"--fix {key}={out[key]} is invalid: every degree is a "
                               "positive integer (1 turns that dimension off).")
    return tuple(out.items())


def _shape_names(text: str) -> set[str]:
    """The setting names a `--model-shape` text gives."""
    return {item.partition("=")[0].strip().lower()
            for item in text.replace(" ", ",").split(",") if item}


def _given_fields(text: str) -> set[str]:
    """The field names a `--layout` text sets."""
    return {item.partition("=")[0].strip().lower() for item in text.replace(",", " ").split()}


def _layout_defaults(text: str, layout, moe: bool = False) -> list[str]:
    """The layout fields `--layout` filled in that change the prediction (`moe`: the
    model has MoE blocks)."""
    given = _given_fields(text)
    out = []
    if "dp" not in given:
        out.append(f"dp={layout.dp} (what --gpus leaves)")
    if "sequence_parallel" not in given and "sp" not in given and layout.tp > 1:
        out.append(f"sequence_parallel={int(layout.sequence_parallel)} (on with tp > 1)")
    for name in ("microbatch_size", "zero_stage", "recompute", "overlap_grad_reduce",
                 "overlap_param_gather", "tp_comm_overlap"):
        if name not in given:
            out.append(f"{name}={getattr(layout, name)}")
    if layout.pp > 1 and "schedule" not in given:
        out.append(f"schedule={layout.schedule}")
    if layout.pp > 1 and not given & VIRTUAL_STAGES_NAMES:
        why = (" (interleaved-1f1b's default, as partita train fills it in)"
               if layout.schedule == "interleaved-1f1b" else "")
        out.append(f"virtual_stages={layout.virtual_stages}{why}")
    if layout.cp > 1 and "cp_kind" not in given:
        out.append(f"cp_kind={layout.cp_kind}")
    if moe and layout.tp > 1 and "moe_tp" not in given:
        out.append(f"moe_tp={layout.moe_tp} (experts whole on every tp rank)")
    return out


def _gemm_fraction_default(gpu) -> list[str]:
    """The GEMM rate a GPU of no catalog family is planned with, and how to set it."""
    from partita.planner.compute import GEMM_PEAK_FRACTION, gemm_family
    from partita.planner.hardware import GPUProfile

    if gemm_family(gpu):
        return []
    how = (f'no base GPU given: set base = "H100" (or another catalog GPU) in '
           f"[gpu.{gpu.name}], or --set gemm_peak_fraction=..."
           if isinstance(gpu, GPUProfile) else "--set gemm_peak_fraction=... to change it")
    return [f"gemm_peak_fraction {GEMM_PEAK_FRACTION['default']} ({how})"]


def _print_defaults(defaults: list[str]) -> None:
    if defaults:
        print("Defaults filled in: " + "; ".join(defaults))


def _print_advice(advice: list[str], nothing_fits: bool = False,
                  fixed: tuple[tuple[str, object], ...] = ()) -> None:
    if advice:
        print("Smallest change that would fit: " + advice[0])
        for line in advice[1:]:
            print("  or " + line)
    elif nothing_fits and fixed:  # the advice keeps the pins: say that they are the limit
        from partita.planner.advice import fix_text

        print(f"No layout with --fix {fix_text(fixed)} fits, even with offload, a shorter "
              "sequence, up to 64x the GPUs or a larger GPU, and none fits without the "
              "pins either.")
    elif nothing_fits:
        print("No single change among the ZeRO stage, a smaller microbatch, offload to "
              "host memory or disk, a shorter sequence, up to 64x the GPUs or a larger "
              "GPU makes a layout fit.")
