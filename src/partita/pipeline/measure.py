"""Measured timelines of real pipeline steps: gather, idle fraction, activation peaks, PNG.

The runner records (action, start, end) for every action of its last step, in seconds
from the step's start. Gathered over the pipeline group they have the shape the
simulator produces, so the same drawing and the same bubble arithmetic apply. Ranks'
clocks are aligned on the shared monotonic clock when they run on one host; across
hosts each rank's step start is its zero (right after a barrier, as the benchmark
does, those agree to well under a pass).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from partita.pipeline.actions import Kind, Schedule
from partita.pipeline.render import draw_timeline
from partita.pipeline.simulate import Event


def gather_rows(runner) -> list[list[Event]]:
    """Every pipeline rank's timeline of the last step, in pipeline-rank order.
    Collective over the runner's pipeline group: every member must call it.

    Ranks on one host share the monotonic clock, so their rows are put on one time axis
    (0 = the earliest start); across hosts each row keeps its own step start as 0."""
    comm = runner.transport.comm
    mine = (socket.gethostname(), runner.step_started, list(runner.timeline))
    if comm.size == 1:
        return [mine[2]]
    parts: list = [None] * comm.size
    dist.all_gather_object(parts, mine, group=comm.group)
    if len({host for host, _, _ in parts}) > 1:
        return [rows for _, _, rows in parts]
    origin = min(start for _, start, _ in parts)
    return [[(a, s + start - origin, e + start - origin) for a, s, e in rows]
            for _, start, rows in parts]


def idle_fraction(rows: Sequence[Sequence[Event]]) -> float:
    """Share of p x (step time) that ranks spend not computing (waiting, transferring,
    or done early): the measured counterpart of `Timeline.bubble_fraction`."""
    makespan = max((end for row in rows for _, _, end in row), default=0.0)
    if makespan <= 0:
        return 0.0
    busy = sum(end - start for row in rows for a, start, end in row if a.kind.is_compute)
    return 1.0 - busy / (makespan * len(rows))


def action_durations(row: Sequence[Event]) -> dict:
    """Compute time per action of one rank. An action may run in pieces: zero bubble's
    last stage records the output projection's weight pass, run after I's send, as a
    second piece of that I (`PipelineRunner._run_early`)."""
    took: dict = {}
    for a, start, end in row:
        if a.kind.is_compute:
            took[a] = took.get(a, 0.0) + end - start
    return took


def pass_times(rows: Sequence[Sequence[Event]]) -> dict[str, float]:
    """Mean duration of each compute kind over all ranks ('F', 'B', 'I', 'W')."""
    sums: dict[str, list[float]] = {}
    for row in rows:
        for a, took in action_durations(row).items():
            sums.setdefault(a.kind.value, []).append(took)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def transfer_waits(rows: Sequence[Sequence[Event]]) -> float:
    """Share of p x (step time) that receivers spent waiting after the matching send was
    posted: the transfers' own latency on the critical path, which a replay with free
    transfers leaves out. Needs the rows on one clock (ranks on one host)."""
    makespan = max((end for row in rows for _, _, end in row), default=0.0)
    posted = {a.transfer_key: start for row in rows for a, start, _ in row
              if a.kind.is_send}
    waited = sum(end - max(start, posted.get(a.transfer_key, start))
                 for row in rows for a, start, end in row if a.kind.is_recv)
    return waited / (makespan * len(rows)) if makespan > 0 else 0.0


def held_peaks(rows: Sequence[Sequence[Event]]) -> dict[int, int]:
    """Per stage, the most microbatches between a forward's start and the end of their
    backward (B, or W when split) in the recorded order."""
    peaks: dict[int, int] = {}
    for row in rows:
        live: dict[int, int] = {}
        for a, _, _ in sorted(row, key=lambda e: e[1]):
            if a.kind is Kind.F:
                live[a.stage] = live.get(a.stage, 0) + 1
                peaks[a.stage] = max(peaks.get(a.stage, 0), live[a.stage])
            elif a.kind in (Kind.B, Kind.W):
                live[a.stage] = live.get(a.stage, 0) - 1
    return peaks


def save_timeline(runner, path: str | Path, title: str = "") -> Path | None:
    """Gather the last step's timeline and draw it (global rank 0 writes the PNG).
    Collective over the pipeline group; returns the path on the writing rank."""
    rows = gather_rows(runner)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    idle = idle_fraction(rows)
    label = title or f"measured {runner.schedule_name}"
    return draw_timeline(rows, path, title=f"{label}  idle {idle:.1%}",
                         n_virtual=runner.layout.n_virtual, time_unit="s")


def replay_idle(sched: Schedule, rows: Sequence[Sequence[Event]]) -> float:
    """The idle fraction this schedule would have if every pass took exactly the time it
    was measured to take and transfers were free: the theory for *this* run, which the
    measured idle fraction exceeds only by transfer latency and runtime overhead."""
    took = [action_durations(row) for row in rows]
    posted: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * sched.n_ranks
    index = [0] * sched.n_ranks
    busy = 0.0
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(sched.ranks):
            while index[r] < len(acts):
                a = acts[index[r]]
                key = a.transfer_key
                if a.kind.is_recv:
                    if key not in posted:
                        break
                    clock[r] = max(clock[r], posted[key])
                elif a.kind.is_send:
                    posted[key] = clock[r]
                else:
                    clock[r] += took[r].get(a, 0.0)
                    busy += took[r].get(a, 0.0)
                index[r] += 1
                progress = True
    makespan = max(clock)
    return 1.0 - busy / (makespan * sched.n_ranks) if makespan > 0 else 0.0
