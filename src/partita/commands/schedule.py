"""`partita schedule NAME`: print a pipeline schedule as a time x rank grid.

Runs no processes: the schedule is generated, validated and simulated in unit time
(F=1, B=2, I=W=1), then printed; `--png FILE` also draws it.
"""

from __future__ import annotations

import argparse

from partita.commands import PICTURE_FORMATS, check_output_file
from partita.errors import require_in_range
from partita.pipeline import (
    build_schedule,
    draw_timeline,
    format_grid,
    legend,
    simulate,
    summary,
    validate,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "schedule",
        help="print (and draw) a pipeline schedule",
        description="Show which pass every pipeline rank runs at each time step.",
    )
    parser.add_argument("name", metavar="NAME", help="gpipe, 1f1b, interleaved-1f1b, zb-h1")
    parser.add_argument("--stages", "-p", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=int, required=True)
    parser.add_argument(
        "--virtual", "-v", type=int, help="stages per rank (default 2 for interleaved, else 1)"
    )
    parser.add_argument("--png", metavar="FILE", help="also draw the schedule into FILE")
    parser.add_argument(
        "--actions", action="store_true", help="also list every rank's actions (F0.1 SF0.1 ...)"
    )
    parser.set_defaults(func=run)


# Actions (stages x microbatches x virtual stages) a schedule may have: about 2 s to
# build, validate, simulate and print on one CPU core; a bigger one is no drawing to read.
MAX_CELLS = 8192


def run(args: argparse.Namespace) -> int:
    require_in_range("--stages", args.stages, 1, MAX_CELLS)
    require_in_range("--microbatches", args.microbatches, 1, MAX_CELLS)
    require_in_range("--virtual", args.virtual, 1, 64)
    if args.png is not None:  # an empty name too: it would silently draw nothing
        check_output_file(args.png, "--png", PICTURE_FORMATS)
    cells = args.stages * args.microbatches * (args.virtual or 1)
    require_in_range("--stages x --microbatches x --virtual", cells, 1, MAX_CELLS,
                     "draw a smaller pipeline (the schedule's shape repeats)")
    sched = build_schedule(args.name, args.stages, args.microbatches, args.virtual)
    validate(sched)
    timeline = simulate(sched)
    print(summary(timeline))
    print(format_grid(timeline))
    print(legend(sched.n_virtual))
    if args.actions:
        print(sched.format())
    if args.png is not None:
        title = f"{sched.name}  p={sched.n_ranks} m={sched.n_microbatches} v={sched.n_virtual}"
        path = draw_timeline(timeline.rows, args.png, title=title, n_virtual=sched.n_virtual)
        print(f"wrote {path}")
    return 0
