"""Run a schedule's action lists without processes: order checks, deadlocks, timings.

The simulator follows the contract the runtime follows (see `partita.pipeline`):

- every rank executes its list strictly in order, one action at a time;
- a compute action (F/B/I/W) may only use tensors already made or received on this
  rank — if its input is not there yet, the *order* is wrong (no waiting helps);
- SEND is non-blocking: it is posted when reached and the rank goes on at once;
- RECV blocks the rank until the matching SEND has been posted by its peer.

If every unfinished rank sits on a RECV whose SEND will never be posted, that is a
deadlock and it is reported with each stuck rank and action. Time is in abstract
units (`Costs`): compute takes its cost, a send arrives `comm` after it is posted.
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.pipeline.actions import Action, Kind, Schedule, ScheduleError

# (action, start, end) — the same shape the runtime records from a real run, in seconds.
Event = tuple[Action, float, float]


@dataclass(frozen=True)
class Costs:
    """Duration of each pass per stage, and of one transfer, in abstract time units."""

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 - the paper's name
    W: float = 1.0
    comm: float = 0.0

    def of(self, kind: Kind) -> float:
        return float(getattr(self, kind.name)) if kind.is_compute else 0.0


@dataclass(frozen=True)
class Timeline:
    """Start and end of every action of every rank, from `simulate`."""

    schedule: Schedule
    rows: tuple[tuple[Event, ...], ...]

    @property
    def makespan(self) -> float:
        return max((end for row in self.rows for _, _, end in row), default=0.0)

    def busy(self, rank: int) -> float:
        """Time `rank` spends computing."""
        return sum(end - start for a, start, end in self.rows[rank] if a.kind.is_compute)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time between step start and the last action's end."""
        total = self.makespan * len(self.rows)
        if total == 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(len(self.rows))) / total


def _missing_input(schedule: Schedule, rank: int, a: Action, done: set[Action]) -> str | None:
    """Name of the action that must precede `a` on this rank but has not run, or None."""
    s, mb = a.stage, a.microbatch

    def have(*candidates: Action) -> bool:
        return any(c in done for c in candidates)

    need: tuple[Action, ...] = ()
    if a.kind is Kind.F and s > 0:
        if schedule.rank_of(s - 1) == rank:
            need = (Action(Kind.F, s - 1, mb),)
        else:
            need = (Action(Kind.RECV_F, s - 1, mb),)
    elif a.kind in (Kind.B, Kind.I):
        if not have(Action(Kind.F, s, mb)):
            return f"F{s}.{mb}"
        if s < schedule.last_stage:
            if schedule.rank_of(s + 1) == rank:
                need = (Action(Kind.B, s + 1, mb), Action(Kind.I, s + 1, mb))
            else:
                need = (Action(Kind.RECV_B, s + 1, mb),)
    elif a.kind is Kind.W:
        need = (Action(Kind.I, s, mb),)
    elif a.kind is Kind.SEND_F:
        need = (Action(Kind.F, s, mb),)
    elif a.kind is Kind.SEND_B:
        need = (Action(Kind.B, s, mb), Action(Kind.I, s, mb))
    if need and not have(*need):
        return " or ".join(str(n) for n in need)
    return None


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Execute every rank's list under the runtime contract and time each action.

    Raises `ScheduleError` when an action comes before its input on the same rank, or
    when the ranks deadlock (every unfinished rank waits on a RECV never sent).
    Structural rules (right ranks, each pass once, sends matched) are `validate`'s job.
    """
    costs = costs or Costs()
    p = schedule.n_ranks
    index = [0] * p
    clock = [0.0] * p
    done: list[set[Action]] = [set() for _ in range(p)]
    posted: dict[tuple[str, int, int], float] = {}  # send key -> arrival time at the peer
    rows: list[list[Event]] = [[] for _ in range(p)]

    progress = True
    while progress:
        progress = False
        for r in range(p):
            acts = schedule.ranks[r]
            while index[r] < len(acts):
                a = acts[index[r]]
                if a.kind.is_recv:
                    arrival = posted.get(a.transfer_key)
                    if arrival is None:
                        break  # blocked: the peer has not posted the send yet
                    start, end = clock[r], max(clock[r], arrival)
                else:
                    missing = _missing_input(schedule, r, a, done[r])
                    if missing is not None:
                        raise ScheduleError(
                            f"rank {r}, action #{index[r]} {a}: needs {missing} earlier on "
                            "this rank; fix the order of that rank's actions."
                        )
                    start = clock[r]
                    end = start + costs.of(a.kind)
                    if a.kind.is_send:
                        posted[a.transfer_key] = start + costs.comm
                clock[r] = end
                rows[r].append((a, start, end))
                done[r].add(a)
                index[r] += 1
                progress = True

    stuck = [r for r in range(p) if index[r] < len(schedule.ranks[r])]
    if stuck:
        lines = []
        for r in stuck:
            a = schedule.ranks[r][index[r]]
            peer = schedule.rank_of(a.stage)
            send = Kind.SEND_F if a.kind is Kind.RECV_F else Kind.SEND_B
            lines.append(
                f"rank {r} waits at action #{index[r]} {a} for {Action(send, a.stage, a.microbatch)} "
                f"from rank {peer}"
            )
        raise ScheduleError(
            "the schedule deadlocks: " + "; ".join(lines) + ". A receive must not come "
            "before something its sender needs from this rank."
        )
    return Timeline(schedule, tuple(tuple(row) for row in rows))


def in_flight_peaks(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most microbatches whose activations it holds at once.

    A microbatch is in flight on a stage from its F until its backward is complete (B,
    or W when the backward is split — W still needs the saved inputs). Counted in each
    rank's action order, so it holds for any timing of the same schedule.
    """
    peaks = {s: 0 for s in range(schedule.n_stages)}
    for acts in schedule.ranks:
        live = {s: 0 for s in range(schedule.n_stages)}
        for a in acts:
            if a.kind is Kind.F:
                live[a.stage] += 1
                peaks[a.stage] = max(peaks[a.stage], live[a.stage])
            elif a.kind in (Kind.B, Kind.W):
                live[a.stage] -= 1
    return peaks


def rank_in_flight_peak(schedule: Schedule, rank: int) -> int:
    """Most (stage, microbatch) activation sets `rank` holds at once over all its stages."""
    live = peak = 0
    for a in schedule.ranks[rank]:
        if a.kind is Kind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind in (Kind.B, Kind.W):
            live -= 1
    return peak
