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

import errno
import os
import signal
from dataclasses import dataclass

from partita.errors import PartitaError, print_line

# Points of a training step, in the order a step reaches them.
POINTS = ("forward", "backward", "reduction", "optimizer", "weight_write")
# Pipeline layouts only: when the rank posts its first send / receive of the step.
PIPELINE_POINTS = ("pipeline_send", "pipeline_recv")
# On the checkpoint writer's thread, before it writes the checkpoint of that step.
CHECKPOINT_POINTS = ("checkpoint_write",)
# Process 0 alone, after the weights are written, before it exports them (train.export).
END_POINTS = ("export",)
KINDS = ("kill", "stop", "raise")
# Blocks in native code for good, its heartbeat running on: a deadlock, a disk that does
# not answer. Only the tail's watches can tell it (the steps' collectives time out).
HANG_KINDS = ("hang",)
INJECTED = "partita: injecting fault:"  # the line a rank prints as it fires its fault
# The write at this point fails as on a full disk.
WRITE_KINDS = ("enospc",)
# An allocation fails as on a full GPU (torch.OutOfMemoryError, on any device), or as
# torch's CPU allocator fails when the machine cannot give it the memory.
MEMORY_KINDS = ("oom", "host_oom")
HOST_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"
ENV = "PARTITA_FAULT"


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws (a bug's stand-in, not a user error)."""


@dataclass(frozen=True)
class FaultPlan:
    rank: int
    step: int  # 1-based, as logged
    at: str
    do: str
    # Which start of the job it fires in: 0 the first; n the n-th restart by the
    # launcher (--max-restarts), so a fault need not repeat after each restart.
    attempt: int = 0

    def __post_init__(self) -> None:
        points = POINTS + PIPELINE_POINTS + CHECKPOINT_POINTS + END_POINTS
        kinds = KINDS + HANG_KINDS + WRITE_KINDS + MEMORY_KINDS
        if self.at not in points or self.do not in kinds:
            raise PartitaError(f"{ENV}: at must be one of {', '.join(points)} and do one "
                               f"of {', '.join(kinds)}; got at={self.at}, do={self.do}.")

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        try:
            fields = dict(item.split("=", 1) for item in text.split(","))
            return cls(int(fields["rank"]), int(fields["step"]), fields["at"], fields["do"],
                       int(fields.get("attempt", 0)))
        except (KeyError, ValueError):
            raise PartitaError(f"{ENV}='{text}' is not of the form "
                               "rank=R,step=S,at=POINT,do=KIND[,attempt=N].") from None


def fault_from_env() -> FaultPlan | None:
    """The plan in the environment, if it is for this start of the job."""
    text = os.environ.get(ENV, "")
    plan = FaultPlan.parse(text) if text else None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return plan if plan is not None and plan.attempt == restart else None


class Faults:
    """This rank's view of a plan: `reach(point, step)` fires it once when due."""

    def __init__(self, plan: FaultPlan | None, rank: int) -> None:
        self.plan = plan if plan is not None and plan.rank == rank else None

    def reach(self, point: str, step: int) -> None:
        plan = self.plan
        if plan is None or plan.at != point or plan.step != step:
            return
        self.plan = None  # once
        # Said first, so that a test can tell a job that failed before its fault was due
        # (a rank slower than the timeouts on a loaded machine) from the fault's effect.
        print_line(f"{INJECTED} {plan.do} at {point} of step {step}")
        if plan.do == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif plan.do == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif plan.do == "hang":
            # A read no one will answer: the main thread waits in the kernel, the GIL
            # released, using no CPU, while the process's other threads run.
            never_read, _kept_open = os.pipe()
            while True:
                os.read(never_read, 1)
        elif plan.do == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
        elif plan.do == "oom":
            import torch

            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB "
                                         f"(injected at {point})")
        elif plan.do == "host_oom":
            raise RuntimeError(f"[enforce fail at alloc_cpu.cpp:127] err == 0. "
                               f"{HOST_ALLOCATION_FAILED}: you tried to allocate 2147483648 "
                               f"bytes. Error code 12 (injected at {point})")
        else:
            raise InjectedFault(f"injected fault at {point} of step {step}")
