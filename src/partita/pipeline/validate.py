"""Check a schedule before any process runs it.

Two layers: structural rules read off the action lists (every action on the rank that
owns its stage, each forward and backward exactly once, every cross-rank tensor sent
once and received once by the right peer), then a simulation under the runtime
contract that catches wrong order on a rank and deadlocks between ranks.
"""

from __future__ import annotations

from collections import Counter

from partita.pipeline.actions import Action, Kind, Schedule, ScheduleError
from partita.pipeline.simulate import simulate

_MAX_REPORTED = 8


def _placement_problems(sched: Schedule) -> list[str]:
    """Actions with out-of-range indices or on a rank that does not hold their stage."""
    out = []
    for r, acts in enumerate(sched.ranks):
        for i, a in enumerate(acts):
            where = f"rank {r}, action #{i} {a}"
            if not 0 <= a.microbatch < sched.n_microbatches:
                out.append(f"{where}: microbatch out of range 0..{sched.n_microbatches - 1}")
                continue
            if not 0 <= a.stage < sched.n_stages or not 0 <= a.local_stage < sched.n_stages:
                out.append(f"{where}: stage out of range 0..{sched.last_stage}")
                continue
            if sched.rank_of(a.local_stage) != r:
                out.append(
                    f"{where}: stage {a.local_stage} lives on rank {sched.rank_of(a.local_stage)}"
                )
            elif a.kind.is_send or a.kind.is_recv:
                peer = a.peer_stage
                if peer is None or not 0 <= peer < sched.n_stages:
                    out.append(f"{where}: no stage {peer} to exchange with")
                elif sched.rank_of(peer) == r:
                    out.append(f"{where}: stage {peer} is on this same rank; no transfer needed")
    return out


def _count_problems(sched: Schedule) -> list[str]:
    """Each (stage, microbatch) runs F once and either B once or I and W once each."""
    counts = Counter(
        (a.kind, a.stage, a.microbatch) for acts in sched.ranks for a in acts if a.kind.is_compute
    )
    out = []
    for s in range(sched.n_stages):
        for mb in range(sched.n_microbatches):
            f, b, i, w = (counts[(k, s, mb)] for k in (Kind.F, Kind.B, Kind.I, Kind.W))
            if f != 1:
                out.append(f"F{s}.{mb} appears {f} times; it must appear exactly once")
            split_ok = b == 0 and i == 1 and w == 1
            if not (b == 1 and i == 0 and w == 0) and not split_ok:
                out.append(
                    f"backward of stage {s}, microbatch {mb} appears as B x{b}, I x{i}, W x{w}; "
                    "it must be one B, or one I and one W"
                )
    return out


def _transfer_problems(sched: Schedule) -> list[str]:
    """Every tensor crossing ranks is sent exactly once and received exactly once."""
    have = Counter(a for acts in sched.ranks for a in acts if a.kind.is_send or a.kind.is_recv)
    need: set[Action] = set()
    for s in range(sched.n_stages):
        for mb in range(sched.n_microbatches):
            if s < sched.last_stage and sched.rank_of(s) != sched.rank_of(s + 1):
                need |= {Action(Kind.SEND_F, s, mb), Action(Kind.RECV_F, s, mb)}
            if s > 0 and sched.rank_of(s) != sched.rank_of(s - 1):
                need |= {Action(Kind.SEND_B, s, mb), Action(Kind.RECV_B, s, mb)}
    out = []
    for a in sorted(need | set(have), key=lambda a: (a.microbatch, a.stage, a.kind.value)):
        n = have[a]
        if a in need and n == 0:
            out.append(f"{a} is missing (needed by the rank of stage {a.local_stage})")
        elif n > 1:
            out.append(f"{a} appears {n} times; each transfer happens exactly once")
        elif a not in need:
            out.append(f"{a} has no counterpart: nothing crosses ranks there")
    return out


def find_problems(sched: Schedule) -> list[str]:
    """Every rule `sched` breaks, as sentences; empty when it is valid."""
    if len(sched.ranks) != sched.n_ranks:
        return [f"{len(sched.ranks)} action lists for {sched.n_ranks} ranks"]
    problems = _placement_problems(sched)
    if problems:  # later checks assume actions sit on the right ranks
        return problems
    problems = _count_problems(sched) + _transfer_problems(sched)
    if problems:
        return problems
    try:
        simulate(sched)
    except ScheduleError as exc:
        return [str(exc)]
    return []


def validate(sched: Schedule) -> None:
    """Raise `ScheduleError` naming the broken rules (the first few) if any."""
    problems = find_problems(sched)
    if problems:
        shown = problems[:_MAX_REPORTED]
        more = len(problems) - len(shown)
        tail = f" (and {more} more)" if more else ""
        raise ScheduleError(
            f"schedule '{sched.name}' (p={sched.n_ranks}, m={sched.n_microbatches}, "
            f"v={sched.n_virtual}) is invalid: " + "; ".join(shown) + tail + "."
        )
