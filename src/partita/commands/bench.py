"""`partita bench NAME`: side-by-side measurements against the peers.

Each benchmark is a module under partita.bench exposing `add_arguments(parser)` and
`run(args) -> int`; its last printed line is a one-line verdict such as
`dp: partita/torch-ddp step-time ratio 0.97`. Every run's first line names the machine
(`partita.bench.machine`).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
from collections.abc import Callable

BENCHMARKS = {
    "dp": "partita.bench.dp",
    "zero": "partita.bench.zero",
    "zero-memory": "partita.bench.zero_memory",
    "zero-comm": "partita.bench.zero_comm",
    "checkpoint": "partita.bench.checkpoint",
    "tp": "partita.bench.tp",
    "tp-comm": "partita.bench.tp_comm",
    "pp": "partita.bench.pp",
    "pp-bubble": "partita.bench.pp_bubble",
    "recompute": "partita.bench.recompute",
    "offload": "partita.bench.offload",
    "cp": "partita.bench.cp",
    "ep": "partita.bench.ep",
    "plan-accuracy": "partita.bench.plan_accuracy",
    "gpu": "partita.bench.gpu",
    "compile": "partita.bench.compile",
}


def summary(path: str) -> str | None:
    """The first line of benchmark module `path`'s docstring, read from its source:
    importing a benchmark imports torch (seconds), which `partita --help` and `partita
    bench --help` need not wait for. None when the module is not there."""
    spec = importlib.util.find_spec(path)
    if spec is None or spec.origin is None:
        return None
    with open(spec.origin, encoding="utf-8") as source:
        lines = (ast.get_docstring(ast.parse(source.read())) or "").strip().splitlines()
    return lines[0] if lines else ""


def register(subparsers: argparse._SubParsersAction, benchmark: str | None = None) -> None:
    """`bench` and its benchmarks. Only `benchmark`'s module (the one the command line
    names, if any) is imported to add its options; the others are listed by name and
    summary."""
    parser = subparsers.add_parser("bench", help="measure partita side by side with a peer")
    names = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, path in BENCHMARKS.items():
        line = summary(path)
        if line is None:  # not in this build
            continue
        if name != benchmark:
            names.add_parser(name, help=line)
            continue
        module = importlib.import_module(path)
        options = {"description": module.__doc__.strip()} if name == "plan-accuracy" else {}
        sub = names.add_parser(name, help=line, **options)
        module.add_arguments(sub)
        run = _plan_accuracy_checked if name == "plan-accuracy" else module.run
        # A partial of module-level functions, not a closure: several benchmarks send
        # their parsed arguments (this `func` among them) to their worker processes,
        # and a closure cannot be pickled.
        sub.set_defaults(func=functools.partial(_naming_the_machine, run,
                                                sub.get_default("max_rounds")))


def _plan_accuracy_checked(args: argparse.Namespace) -> int:
    """`partita bench plan-accuracy`, its model's shape checked before any rank starts:
    --dim must split into the model's heads, each of even width (rotary positions)."""
    from partita.bench import plan_accuracy
    from partita.bench.plan_measure import Shape
    from partita.errors import PartitaError

    heads = Shape.n_heads
    multiple = 2 * heads  # heads of even width
    if args.dim % multiple:
        lower = args.dim // multiple * multiple
        near = " or ".join(str(d) for d in (lower, lower + multiple) if d > 0)
        raise PartitaError(f"--dim {args.dim}: plan-accuracy's model has {heads} attention "
                           f"heads of even width (rotary positions), so --dim must be a "
                           f"multiple of {multiple}; try --dim {near}.")
    return plan_accuracy.run(args)


def _naming_the_machine(run: Callable[[argparse.Namespace], int],
                        default_cap: int | None, args: argparse.Namespace) -> int:
    """`run(args)` after a first line that names the machine."""
    from partita.bench.machine import describe_machine
    from partita.errors import PartitaError

    # Rounds start at --rounds and double up to --max-rounds while the ratio's interval
    # is wide. A --rounds beyond the default cap lifts it; a cap the user gave below
    # the start would be ignored without a word, so it is refused.
    rounds, cap = getattr(args, "rounds", None), getattr(args, "max_rounds", None)
    if rounds is not None and cap is not None and cap != default_cap and rounds > cap:
        raise PartitaError(f"--rounds {rounds} is more than --max-rounds {cap}, the most "
                           f"rounds a pair may take: give --max-rounds {rounds} or more, "
                           f"or fewer --rounds.")

    print(describe_machine(), flush=True)
    return run(args)
