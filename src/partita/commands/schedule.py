"""`partita schedule NAME`: print a pipeline schedule as a time x rank grid.

Runs no processes: the schedule is generated, validated and simulated in unit time
(F=1, B=2, I=W=1), then printed; `--png FILE` also draws it.
"""

from __future__ import annotations

import argparse

from partita.commands import PICTURE_FORMATS, check_output_file
from partita.errors import PartitaError, require_in_range
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


# Two things cost time, each bounded to about 1 s on one CPU core (2 s together), and
# a bigger schedule is no drawing to read anyway:
# - the actions (stages x microbatches x virtual stages), each built, validated and
#   simulated;
# - the printed grid, ranks x time steps: the simulation sweeps every rank at each step,
#   and a schedule lasts about stages - 1 + microbatches x virtual steps of each rank,
#   so the cost grows with the square of the stages (8,192 stages took 111 s).
MAX_CELLS = 8192
MAX_GRID = 1 << 20


def run(args: argparse.Namespace) -> int:
    require_in_range("--stages", args.stages, 1, MAX_CELLS)
    require_in_range("--microbatches", args.microbatches, 1, MAX_CELLS)
    require_in_range("--virtual", args.virtual, 1, 64)
    if args.png is not None:  # an empty name too: it would silently draw nothing
        check_output_file(args.png, "--png", PICTURE_FORMATS)
    cells = args.stages * args.microbatches * (args.virtual or 1)
    require_in_range("--stages x --microbatches x --virtual", cells, 1, MAX_CELLS,
                     "draw a smaller pipeline (the schedule's shape repeats)")
    grid = args.stages * (args.stages - 1 + args.microbatches * (args.virtual or 1))
    if grid > MAX_GRID:
        raise PartitaError(
            f"--stages {args.stages} gives a grid of about {grid:,} cells (stages x "
            f"(stages - 1 + microbatches x virtual)), more than the {MAX_GRID:,} "
            "drawn in a few seconds; draw fewer stages (at most "
            f"{_most_stages(args.microbatches * (args.virtual or 1)):,} with these "
            "microbatches): the schedule's shape repeats."
        )
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


def _most_stages(per_rank: int) -> int:
    """The most stages whose grid stays within MAX_GRID with `per_rank` steps each."""
    p = 1
    while (p + 1) * (p + per_rank) <= MAX_GRID:
        p += 1
    return p
