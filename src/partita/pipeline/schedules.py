"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1 — pure functions.

Each generator decides only the order of *compute* passes on every rank; the sends
and receives are then placed by one rule (`_with_transfers`) shared by all of them:

- a SEND comes right after the pass that produced the tensor, so it is posted as
  early as possible (sends never block, see the runtime contract in `__init__`);
- a RECV comes right before the pass that consumes the tensor, so the rank blocks no
  earlier than it must.

Because every send is posted as soon as its tensor exists, a schedule whose compute
order respects the data dependencies can never deadlock; `validate` still checks it.
Consecutive transfers (e.g. 1F1B's send-forward + receive-backward) end up adjacent
so the runtime can post them as one `batch_isend_irecv`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from partita.errors import PartitaError, did_you_mean
from partita.layout import SCHEDULE_ALIASES
from partita.pipeline.actions import Action, Kind, Schedule
from partita.pipeline.simulate import simulate

Order = list[Action]  # one rank's compute passes, in order


def _with_transfers(p: int, v: int, orders: Sequence[Order]) -> tuple[tuple[Action, ...], ...]:
    """Insert SEND/RECV actions around the compute passes of every rank."""
    last = p * v - 1

    def remote(a: int, b: int) -> bool:
        return a % p != b % p

    ranks = []
    for order in orders:
        acts: list[Action] = []
        for a in order:
            s, mb = a.stage, a.microbatch
            if a.kind is Kind.F and s > 0 and remote(s, s - 1):
                acts.append(Action(Kind.RECV_F, s - 1, mb))
            if a.kind in (Kind.B, Kind.I) and s < last and remote(s, s + 1):
                acts.append(Action(Kind.RECV_B, s + 1, mb))
            acts.append(a)
            if a.kind is Kind.F and s < last and remote(s, s + 1):
                acts.append(Action(Kind.SEND_F, s, mb))
            if a.kind in (Kind.B, Kind.I) and s > 0 and remote(s, s - 1):
                acts.append(Action(Kind.SEND_B, s, mb))
        ranks.append(tuple(acts))
    return tuple(ranks)


def _gradient_first_at_the_end(order: Order, rank: int) -> Order:
    """Run the rank's last backward as I then W, so its input gradient leaves one
    weight pass earlier.

    GPipe and 1F1B end on a chain: the last microbatch's backward on rank p-1, then on
    p-2, ..., then on 0, each waiting for the gradient the one after it sends. A whole
    B sends only after its weight gradients too; split, the gradient leaves after I and
    the W runs while the rank before computes. Where the rank before waits at every
    hop (the last stage, with the head and the loss, is the slowest) each hop saves a
    W; with equal stages the ranks run in lockstep and the step is barely shorter
    (p=4, m=8, F=I=W=1: 33 -> 32 units). Only that last backward is split: the others
    are not on the chain, and on CPU an I plus its W cost 8-17% more than one B
    (measured, 2 Llama blocks: almost all of it I's graph walk and capture hooks).
    Rank 0 sends nothing upstream, so it keeps B. W follows its I at once: nothing is
    held longer than a B would hold it.
    """
    if rank == 0 or not order or order[-1].kind is not Kind.B:
        return order
    last = order[-1]
    return order[:-1] + [Action(Kind.I, last.stage, last.microbatch),
                         Action(Kind.W, last.stage, last.microbatch)]


def gpipe_order(p: int, m: int, rank: int) -> Order:
    """All forwards, then all backwards: simplest, but holds all m activations."""
    forwards = [Action(Kind.F, rank, i) for i in range(m)]
    return _gradient_first_at_the_end(
        forwards + [Action(Kind.B, rank, i) for i in range(m)], rank)


def one_f_one_b_order(p: int, m: int, rank: int) -> Order:
    """1F1B: p-rank-1 warm-up forwards, then alternate forward/backward, then drain.

    Same bubble as GPipe, but rank r never holds more than p-r microbatches."""
    warmup = min(p - rank - 1, m)
    order = [Action(Kind.F, rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(Kind.F, rank, warmup + i), Action(Kind.B, rank, i)]
    order += [Action(Kind.B, rank, i) for i in range(m - warmup, m)]
    return _gradient_first_at_the_end(order, rank)


def interleaved_order(p: int, m: int, v: int, rank: int) -> Order:
    """Megatron's interleaved 1F1B over v model chunks per rank.

    Microbatches go through the chunks in groups of p: forwards of microbatches 0..p-1
    on chunk 0, then the same p on chunk 1, ..., then the next p microbatches. Backward
    visits chunks in reverse. The warm-up is Megatron's: 2 forwards per rank below the
    last plus one full round of chunks. With free transfers a shorter one would do, but
    this slack is what lets transfer time hide behind compute (see the tests).
    """
    if v == 1:  # Megatron's warm-up formula would hold 2x the activations for nothing
        return one_f_one_b_order(p, m, rank)
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        microbatch = (k // (p * v)) * p + k % p
        return chunk * p + rank, microbatch

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [Action(Kind.F, *unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [Action(Kind.F, *unit(warmup + k, True)), Action(Kind.B, *unit(k, False))]
    return order + [Action(Kind.B, *unit(k, False)) for k in range(total - warmup, total)]


def zb_h1_order(p: int, m: int, rank: int) -> Order:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with the backward
    split into I (input gradient, on the critical path) and W (weight gradient).

    F and I keep 1F1B's order, so gradients travel back as fast as in 1F1B but each
    hop costs only I. Rank r defers each W by r microbatches: the later ranks, which
    in 1F1B hold fewer activations, use that slack so the deferred Ws fill the drain
    bubble. Every rank then holds at most p microbatches, 1F1B's count on rank 0; in
    bytes a microbatch waiting for its W holds its linear layers' inputs and output
    gradients, about as much as a whole forward's activations (the planner counts both:
    `partita.planner.schedule_peaks.zero_bubble_peak`).
    """
    order: Order = []
    next_w = 0

    def backward(i: int) -> None:
        nonlocal next_w
        order.append(Action(Kind.I, rank, i))
        if i - next_w >= rank:  # W of microbatch i-rank is now due
            order.append(Action(Kind.W, rank, next_w))
            next_w += 1

    warmup = min(p - rank - 1, m)
    order += [Action(Kind.F, rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order.append(Action(Kind.F, rank, warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    order += [Action(Kind.W, rank, i) for i in range(next_w, m)]
    return order


def _need_single_chunk(name: str, v: int) -> None:
    if v != 1:
        raise PartitaError(
            f"the {name} schedule runs one stage per rank, but --virtual {v} was given; "
            "use interleaved-1f1b for several virtual stages per rank, or drop --virtual."
        )


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    _need_single_chunk("gpipe", v)
    orders = [gpipe_order(p, m, r) for r in range(p)]
    return Schedule("gpipe", p, m, 1, _with_transfers(p, 1, orders))


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    _need_single_chunk("1f1b", v)
    orders = [one_f_one_b_order(p, m, r) for r in range(p)]
    return Schedule("1f1b", p, m, 1, _with_transfers(p, 1, orders))


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    if v < 2 and p > 1:
        raise PartitaError(
            f"interleaved-1f1b with {v} virtual stage per rank has nothing to interleave: "
            "it would be 1F1B under another name. Use 2 or more virtual stages, or the "
            "1f1b schedule.")
    if m % p != 0:
        lower, upper = (m // p) * p, (m // p + 1) * p
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise PartitaError(
            f"interleaved-1f1b sends microbatches round the {p} pipeline stages in groups "
            f"of {p}, so the number of microbatches must be a multiple of {p}; got {m}. "
            f"Use {hint} microbatches, or the 1f1b schedule."
        )
    orders = [interleaved_order(p, m, v, r) for r in range(p)]
    return Schedule("interleaved-1f1b", p, m, v, _with_transfers(p, v, orders))


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    _need_single_chunk("zb-h1", v)
    orders = [zb_h1_order(p, m, r) for r in range(p)]
    return Schedule("zb-h1", p, m, 1, _with_transfers(p, 1, orders))


GENERATORS: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
}
# Short names `partita schedule` accepts; one table with the layout's (partita.layout).
ALIASES = SCHEDULE_ALIASES


def schedule_names() -> list[str]:
    """Every accepted name, canonical names first."""
    return list(GENERATORS) + list(ALIASES)


def build_schedule(
    name: str, stages: int, microbatches: int, virtual: int | None = None
) -> Schedule:
    """The named schedule for `stages` pipeline ranks, `microbatches`, and `virtual`
    stages per rank (so the model is cut into stages*virtual pieces). `virtual`
    defaults to 2 for interleaved-1f1b (which refuses 1: that is plain 1F1B) and 1
    otherwise.

    Raises `PartitaError` for an unknown name or impossible sizes, before any process
    could wait on a schedule that does not exist.
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in GENERATORS:
        raise PartitaError(
            f"unknown pipeline schedule '{name}'.{did_you_mean(name, schedule_names())} "
            f"Known schedules: {', '.join(schedule_names())}."
        )
    if virtual is None:
        virtual = 2 if key == "interleaved-1f1b" else 1
    for what, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise PartitaError(f"--{what} must be a whole number of at least 1; got {value!r}.")
    return GENERATORS[key](stages, microbatches, virtual)


def forward_only(sched: Schedule) -> Schedule:
    """The schedule's forwards and their transfers only (evaluation); still ordered."""
    keep = (Kind.F, Kind.SEND_F, Kind.RECV_F)
    ranks = tuple(tuple(a for a in acts if a.kind in keep) for acts in sched.ranks)
    out = Schedule(sched.name + "-forward", sched.n_ranks, sched.n_microbatches,
                   sched.n_virtual, ranks)
    simulate(out)  # raises if it could deadlock
    return out
