"""Injected process faults, for the fault-injection tests.

A `FaultPlan` says which rank fails, at which step, at which point of the step, and
how: killed (SIGKILL), stopped (SIGSTOP: alive but silent, the hardest case for its
peers) or raising an exception while staying a well-behaved process. The trainer
calls `plan.reach(point, step)` at each point; with no plan that is a no-op.

The plan is read once, where a worker starts, from the PARTITA_FAULT environment
variable (for example `rank=1,step=3,at=backward,do=stop`), and passed down as an
object: the tests drive real `partita train` processes, which only the environment
reaches. It is never set in normal use.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from partita.errors import PartitaError

# Points of a training step, in the order a step reaches them.
POINTS = ("forward", "backward", "reduction", "optimizer", "weight_write")
# Pipeline layouts only: when the rank posts its first send / receive of the step.
PIPELINE_POINTS = ("pipeline_send", "pipeline_recv")
KINDS = ("kill", "stop", "raise")
ENV = "PARTITA_FAULT"


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws (a bug's stand-in, not a user error)."""


@dataclass(frozen=True)
class FaultPlan:
    rank: int
    step: int  # 1-based, as logged
    at: str
    do: str

    def __post_init__(self) -> None:
        if self.at not in POINTS + PIPELINE_POINTS or self.do not in KINDS:
            raise PartitaError(f"{ENV}: at must be one of "
                               f"{', '.join(POINTS + PIPELINE_POINTS)} and do one of "
                               f"{', '.join(KINDS)}; got at={self.at}, do={self.do}.")

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        try:
            fields = dict(item.split("=", 1) for item in text.split(","))
            return cls(int(fields["rank"]), int(fields["step"]), fields["at"], fields["do"])
        except (KeyError, ValueError):
            raise PartitaError(f"{ENV}='{text}' is not of the form "
                               "rank=R,step=S,at=POINT,do=KIND.") from None


def fault_from_env() -> FaultPlan | None:
    text = os.environ.get(ENV, "")
    return FaultPlan.parse(text) if text else None


class Faults:
    """This rank's view of a plan: `reach(point, step)` fires it once when due."""

    def __init__(self, plan: FaultPlan | None, rank: int) -> None:
        self.plan = plan if plan is not None and plan.rank == rank else None

    def reach(self, point: str, step: int) -> None:
        plan = self.plan
        if plan is None or plan.at != point or plan.step != step:
            return
        self.plan = None  # once
        if plan.do == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif plan.do == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise InjectedFault(f"injected fault at {point} of step {step}")
