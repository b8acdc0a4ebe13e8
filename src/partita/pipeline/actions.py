"""Pipeline actions and the `Schedule` that holds every rank's ordered list of them.

A schedule is plain data: for each pipeline rank, the actions it performs in order.
Stages are *global virtual stage* indices 0 .. p*v-1; virtual stage `s` lives on rank
`s % p` (so rank r holds stages r, r+p, r+2p, ... — its "chunks" 0, 1, 2, ...).

Compact printable form, `<code><stage>.<microbatch>`:

    F3.1   forward of stage 3, microbatch 1
    B3.1   full backward (input and weight gradients) of stage 3, microbatch 1
    I3.1   input-gradient backward only (the part on the critical path)
    W3.1   weight-gradient backward (needs I3.1 first; may be deferred)
    SF3.1  send the output activation of F3.1 to the rank of stage 4
    RF3.1  receive the output activation of F3.1 (on the rank of stage 4)
    SB3.1  send the input gradient made by B3.1 / I3.1 to the rank of stage 2
    RB3.1  receive that gradient (on the rank of stage 2)

Send and receive carry the stage that *produced* the tensor, so a send and its
receive print identically apart from S/R — matching them is a string comparison.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from partita.errors import PartitaError


class Kind(enum.Enum):
    """What an action does; the value is its code in the compact form."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the paper's name for the input-gradient pass
    W = "W"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.I, Kind.W)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_F, Kind.RECV_B)


COMPUTE_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W)
_CODES = {k.value: k for k in Kind}
_PATTERN = re.compile(r"^(SF|RF|SB|RB|F|B|I|W)(\d+)\.(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step of one rank: `kind` applied to (`stage`, `microbatch`)."""

    kind: Kind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of `str()`: 'SB2.0' -> Action(Kind.SEND_B, 2, 0)."""
        found = _PATTERN.match(text.strip())
        if not found:
            raise PartitaError(
                f"'{text}' is not a pipeline action; expected <code><stage>.<microbatch> "
                "with code one of F B I W SF RF SB RB, e.g. F3.1 or SB2.0."
            )
        code, stage, mb = found.groups()
        return cls(_CODES[code], int(stage), int(mb))

    @property
    def transfer_key(self) -> tuple[str, int, int]:
        """What a send and its receive share: direction ('F' activation, 'B' input
        gradient), producer stage, microbatch."""
        return ("F" if self.kind in (Kind.SEND_F, Kind.RECV_F) else "B", self.stage,
                self.microbatch)

    @property
    def peer_stage(self) -> int | None:
        """For a send/recv, the stage at the other end of the link (else None).

        Forward traffic goes from `stage` to `stage + 1`, backward traffic from `stage`
        to `stage - 1`; a send's peer is the consumer, a receive's the producer."""
        if self.kind is Kind.SEND_F:
            return self.stage + 1
        if self.kind is Kind.SEND_B:
            return self.stage - 1
        if self.kind.is_recv:
            return self.stage
        return None

    @property
    def local_stage(self) -> int:
        """The stage on *this* rank the action belongs to (a receive's consumer)."""
        if self.kind is Kind.RECV_F:
            return self.stage + 1
        if self.kind is Kind.RECV_B:
            return self.stage - 1
        return self.stage


def parse_actions(text: str) -> tuple[Action, ...]:
    """'F0.0 SF0.0 F0.1' -> a tuple of actions (whitespace or commas between)."""
    return tuple(Action.parse(t) for t in re.split(r"[\s,]+", text.strip()) if t)


class ScheduleError(PartitaError):
    """A schedule breaks a rule: wrong rank, missing pass, bad order, or a deadlock."""


class StageGrid:
    """p ranks with v stages each, stage s on rank s % p (Megatron's round robin).
    Shared by the schedule and the stage split; subclasses define n_ranks, n_virtual."""

    n_ranks: int
    n_virtual: int

    @property
    def n_stages(self) -> int:
        return self.n_ranks * self.n_virtual

    @property
    def last_stage(self) -> int:
        return self.n_stages - 1

    def rank_of(self, stage: int) -> int:
        """The rank holding virtual stage `stage`."""
        return stage % self.n_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages held by `rank`, in model order (chunk 0 first)."""
        return tuple(range(rank, self.n_stages, self.n_ranks))

    def chunk_of(self, stage: int) -> int:
        """Index of `stage` among its rank's stages (0 .. v-1)."""
        return stage // self.n_ranks


@dataclass(frozen=True)
class Schedule(StageGrid):
    """Every rank's ordered actions for one training step of `n_microbatches`.

    `n_ranks` is the pipeline degree p, `n_virtual` the stages per rank v; the model is
    cut into p*v stages. Build schedules with `partita.pipeline.build_schedule`, check
    them with `partita.pipeline.validate`.
    """

    name: str
    n_ranks: int
    n_microbatches: int
    n_virtual: int
    ranks: tuple[tuple[Action, ...], ...]

    def format(self) -> str:
        """One line per rank in the compact form, e.g. 'rank 0: F0.0 SF0.0 ...'."""
        return "\n".join(
            f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.ranks)
        )

    def replace_rank(self, rank: int, actions: Sequence[Action]) -> Schedule:
        """A copy with `rank`'s list replaced — handy for building broken schedules."""
        ranks = list(self.ranks)
        ranks[rank] = tuple(actions)
        return Schedule(self.name, self.n_ranks, self.n_microbatches, self.n_virtual, tuple(ranks))


def deferred_weight_passes(actions: tuple[Action, ...]) -> frozenset[tuple[int, int]]:
    """(stage, microbatch) of every I in `actions` whose W is not the next compute pass
    (zero bubble's deferred W; 1F1B's last backward runs I, its send, then W)."""
    computes = [a for a in actions if a.kind.is_compute]
    return frozenset((a.stage, a.microbatch) for a, after in zip(computes, computes[1:] + [None])
                     if a.kind is Kind.I and after != Action(Kind.W, a.stage, a.microbatch))


def split_backwards(actions: tuple[Action, ...]) -> frozenset[tuple[int, int]]:
    """(stage, microbatch) of every backward in `actions` that runs as I then W."""
    return frozenset((a.stage, a.microbatch) for a in actions if a.kind is Kind.I)


def final_backwards(actions: tuple[Action, ...]) -> dict[int, Action]:
    """Per local stage, its last parameter-gradient pass (B or W) of the step."""
    return {a.stage: a for a in actions if a.kind in (Kind.B, Kind.W)}
