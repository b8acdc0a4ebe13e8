"""Pictures of schedules: a text grid for terminals, coloured boxes as PNG.

Both take timelines: one row per rank of (action, start, end). The simulator makes
them in abstract units; the runtime can record the same shape in seconds from a real
run, and `draw_timeline` draws either.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from partita.errors import PartitaError
from partita.pipeline.actions import Kind
from partita.pipeline.simulate import Event, Timeline, rank_in_flight_peak

IDLE = "."
_COLOURS = {  # colour-blind-friendly (Okabe-Ito)
    Kind.F: "#0072B2",
    Kind.B: "#009E73",
    Kind.I: "#56B4E9",
    Kind.W: "#E69F00",
}
_TRANSFER_COLOUR = "#999999"


def cell_label(kind: Kind, microbatch: int, chunk: int, n_virtual: int) -> str:
    """'F3' = forward of microbatch 3; with v > 1 the chunk is a letter: 'F3b' = chunk 1."""
    suffix = chr(ord("a") + chunk) if n_virtual > 1 else ""
    return f"{kind.value}{microbatch}{suffix}"


def format_grid(timeline: Timeline) -> str:
    """Time x rank grid: one row per rank, one column per time unit, '.' when idle.

    A pass lasting two units fills two columns. Costs must be whole units (the
    default `Costs` are)."""
    sched = timeline.schedule
    width = int(round(timeline.makespan))
    cells = [[IDLE] * width for _ in timeline.rows]
    for r, row in enumerate(timeline.rows):
        for a, start, end in row:
            if not a.kind.is_compute or end == start:
                continue
            if start != int(start) or end != int(end):
                raise PartitaError(
                    "the text grid needs whole-unit costs; draw fractional timelines with "
                    "draw_timeline instead."
                )
            label = cell_label(a.kind, a.microbatch, sched.chunk_of(a.stage), sched.n_virtual)
            for t in range(int(start), int(end)):
                cells[r][t] = label
    cw = max([len(c) for row in cells for c in row] + [1])
    ruler = "".join(f"{t:<{cw + 1}}" if t % 5 == 0 else " " * (cw + 1) for t in range(width))
    lines = [f"{'time':>7}  {ruler}".rstrip()]
    lines += [f"rank {r:>2}  " + " ".join(f"{c:<{cw}}" for c in row) for r, row in enumerate(cells)]
    return "\n".join(line.rstrip() for line in lines)


def legend(n_virtual: int) -> str:
    text = (
        "F forward, B backward, I input-grad backward, W weight-grad backward; number = microbatch"
    )
    if n_virtual > 1:
        text += "; letter = model chunk on the rank (a = first)"
    return text + "; '.' idle"


def summary(timeline: Timeline) -> str:
    """Bubble and per-rank activation peaks, one line each."""
    sched = timeline.schedule
    peaks = [rank_in_flight_peak(sched, r) for r in range(sched.n_ranks)]
    return (
        f"{sched.name}: {sched.n_ranks} ranks, {sched.n_microbatches} microbatches, "
        f"{sched.n_virtual} stage(s) per rank; step {timeline.makespan:g} units, "
        f"bubble {timeline.bubble_fraction:.1%}\n"
        f"peak activations held per rank, in (stage, microbatch) sets: {peaks}"
    )


def draw_timeline(
    rows: Sequence[Sequence[Event]],
    path: str | Path,
    *,
    title: str = "",
    n_virtual: int = 1,
    time_unit: str = "time units",
) -> Path:
    """Draw per-rank timelines of (action, start, end) as coloured boxes into a PNG.

    Works for simulated schedules (abstract units) and measured runs (seconds, pass
    `time_unit="s"`). Transfers with a duration are thin grey bars under the compute.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise PartitaError(
            "drawing a schedule needs matplotlib: pip install matplotlib "
            "(or pip install 'partita[plot]')."
        ) from exc
    p = max(len(rows), 1)
    end_time = max((e for row in rows for _, _, e in row), default=1.0) or 1.0
    # Width follows the number of boxes, not the time unit, so seconds and units both fit.
    boxes = max((sum(a.kind.is_compute for a, _, _ in row) for row in rows), default=1)
    fig = Figure(figsize=(min(max(6.0, 2 + 0.35 * boxes), 30.0), 1.6 + 0.6 * p))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r, row in enumerate(rows):
        y = p - 1 - r  # rank 0 on top, as in the text grid
        for a, start, end in row:
            if end <= start:
                continue
            if not a.kind.is_compute:
                ax.broken_barh([(start, end - start)], (y - 0.45, 0.12), color=_TRANSFER_COLOUR)
                continue
            chunk = a.stage // p
            alpha = 1.0 - 0.45 * chunk / max(n_virtual - 1, 1)
            ax.broken_barh(
                [(start, end - start)],
                (y - 0.3, 0.7),
                facecolors=_COLOURS[a.kind],
                edgecolors="black",
                linewidth=0.4,
                alpha=alpha,
            )
            label = cell_label(a.kind, a.microbatch, chunk, n_virtual)
            ax.text((start + end) / 2, y + 0.05, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {p - 1 - i}" for i in range(p)])
    ax.set_xlim(0, end_time)
    ax.set_xlabel(time_unit)
    if title:
        ax.set_title(title, loc="left")
    handles = [Patch(color=c, label=k.name) for k, c in _COLOURS.items()]
    handles.append(Patch(color=_TRANSFER_COLOUR, label="transfer / waiting to receive"))
    ax.legend(  # below the time axis, so it never covers the title
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(0.0, -0.45),
        fontsize=7,
        ncol=5,
        frameon=False,
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
